"""pentatron.pretrain: the GPT pretraining application (data, tokenizers, checkpoints, training)."""

__version__ = "0.2.3"

__all__: list[str] = []
