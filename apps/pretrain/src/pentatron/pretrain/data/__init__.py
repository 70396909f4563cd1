"""The data pipeline of pentatron.pretrain: Megatron's indexed datasets, GPT samples, blends.

    from pentatron.pretrain.data import (
        IndexedDataset, GPTDatasetConfig, build_train_valid_test_datasets,
        build_pretraining_data_loader, prepare_embedded_corpus,
    )

Names are imported lazily, so the tokenizer and preprocessing tools (and their worker
processes) do not pay for importing torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "BlendedDataset": "blended_dataset",
    "build_blending_indices": "blended_dataset",
    "build_train_valid_test_datasets": "builder",
    "parse_data_path": "builder",
    "parse_split": "builder",
    "split_indices": "builder",
    "EmbeddedCorpus": "embedded_corpus",
    "prepare_embedded_corpus": "embedded_corpus",
    "GPTDataset": "gpt_dataset",
    "GPTDatasetConfig": "gpt_dataset",
    "build_indices": "gpt_dataset",
    "get_ltor_masks_and_position_ids": "gpt_dataset",
    "DType": "indexed_dataset",
    "IndexedDataset": "indexed_dataset",
    "IndexedDatasetBuilder": "indexed_dataset",
    "MockGPTDataset": "mock_dataset",
    "MockIndexedDataset": "mock_dataset",
    "MegatronPretrainingRandomSampler": "samplers",
    "MegatronPretrainingSampler": "samplers",
    "build_pretraining_data_loader": "samplers",
    "collate": "samplers",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
