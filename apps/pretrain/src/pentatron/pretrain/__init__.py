"""pentatron.pretrain: the GPT pretraining application (data, tokenizers, checkpoints, training)."""

__version__ = "0.3.0"

__all__: list[str] = []
