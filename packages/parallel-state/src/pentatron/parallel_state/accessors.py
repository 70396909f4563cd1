"""Megatron-named conveniences over the default grid (`get_tensor_model_parallel_rank()` ...).

Each is a one-line view of `get_default_grid()`; new code should take a `ProcessGrid` or a
group argument instead, so two models with different grids can coexist.
"""

from __future__ import annotations

from typing import Any

from .grid import get_default_grid

# Megatron stem -> grid family. `get_<stem>_group/rank/world_size` are generated below.
_STEMS = {
    "tensor_model_parallel": "tp",
    "pipeline_model_parallel": "pp",
    "context_parallel": "cp",
    "model_parallel": "tp-pp",
    "tensor_and_context_parallel": "tp-cp",
    "expert_model_parallel": "ep",
    "expert_tensor_parallel": "etp",
    "expert_data_parallel": "edp",
    "expert_tensor_and_model_parallel": "etp-ep",
    "expert_tensor_model_pipeline_parallel": "etp-ep-pp",
}


def _make(family: str, what: str) -> Any:
    def accessor() -> Any:
        grid = get_default_grid()
        return {"group": grid.group, "rank": grid.rank, "world_size": grid.size}[what](family)

    return accessor


for _stem, _family in _STEMS.items():
    for _what in ("group", "rank", "world_size"):
        _fn = _make(_family, _what)
        _fn.__name__ = _fn.__qualname__ = f"get_{_stem}_{_what}"
        _fn.__doc__ = f"`{_what}` of this rank's {_family!r} group in the default grid."
        globals()[_fn.__name__] = _fn


def _dp_family(with_context_parallel: bool) -> str:
    return "dp-cp" if with_context_parallel else "dp"


def get_data_parallel_group(with_context_parallel: bool = False) -> Any:
    return get_default_grid().group(_dp_family(with_context_parallel))


def get_data_parallel_rank(with_context_parallel: bool = False) -> int:
    return get_default_grid().rank(_dp_family(with_context_parallel))


def get_data_parallel_world_size(with_context_parallel: bool = False) -> int:
    return get_default_grid().size(_dp_family(with_context_parallel))


def get_tensor_and_data_parallel_group(with_context_parallel: bool = False) -> Any:
    return get_default_grid().group("tp-dp-cp" if with_context_parallel else "tp-dp")


def get_hierarchical_context_parallel_groups() -> list[Any]:
    """This rank's group at each level of `ParallelConfig.hierarchical_cp` ([] without)."""
    return list(get_default_grid().hierarchical_cp_groups)


def get_embedding_group() -> Any:
    return get_default_grid().group("embedding")


def get_position_embedding_group() -> Any:
    return get_default_grid().group("position-embedding")


def is_pipeline_first_stage(ignore_virtual: bool = True) -> bool:
    return get_default_grid().is_first_stage(ignore_virtual)


def is_pipeline_last_stage(ignore_virtual: bool = True) -> bool:
    return get_default_grid().is_last_stage(ignore_virtual)


def get_pipeline_model_parallel_next_rank() -> int:
    return get_default_grid().next_pipeline_rank


def get_pipeline_model_parallel_prev_rank() -> int:
    return get_default_grid().prev_pipeline_rank


def get_virtual_pipeline_model_parallel_rank() -> int | None:
    return get_default_grid().virtual_pipeline_rank


def set_virtual_pipeline_model_parallel_rank(rank: int) -> None:
    get_default_grid().virtual_pipeline_rank = rank


def get_virtual_pipeline_model_parallel_world_size() -> int | None:
    return get_default_grid().layout.vpp


ACCESSORS = sorted(
    [f"get_{s}_{w}" for s in _STEMS for w in ("group", "rank", "world_size")]
    + [
        n
        for n in dir()
        if n.startswith(
            (
                "get_data",
                "get_tensor_and_data",
                "get_hierarchical",
                "get_embedding",
                "get_position",
                "is_pipeline",
                "get_pipeline_model_parallel_",
                "get_virtual",
                "set_virtual",
            )
        )
    ]
)
ACCESSORS = sorted(set(ACCESSORS))
