"""pentatron.pretrain: the GPT pretraining application (data, tokenizers, checkpoints, training)."""

from importlib.metadata import version as _distribution_version

# the installed distribution's version, so it never drifts from pyproject.toml
__version__ = _distribution_version("pentatron-pretrain")

__all__: list[str] = []
