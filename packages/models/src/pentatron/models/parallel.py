"""`ModelParallel`: what a model needs from the grid (tp group, pipeline position).

`ModelParallel.resolve(config, grid, vp_stage)` reads the sizes from a `ProcessGrid` (None:
the default grid, or one process when torch.distributed is not initialised) and checks them
against the config's `*_model_parallel_size` fields before any collective.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from pentatron.parallel_state import ProcessGrid, get_default_grid, model_parallel_is_initialized

from .config import ModelConfigError, TransformerConfig


@dataclass(frozen=True)
class ModelParallel:
    """Groups and ranks of one model chunk. `grid` is None for a single process."""

    grid: ProcessGrid | None
    tp_group: Any
    tp_size: int
    tp_rank: int
    pp_size: int
    pp_rank: int
    vp_stage: int | None
    vpp: int | None
    cp_size: int = 1
    ep_size: int = 1
    etp_size: int = 1

    @classmethod
    def resolve(
        cls, config: TransformerConfig, grid: ProcessGrid | None, vp_stage: int | None
    ) -> ModelParallel:
        grid = _default_grid(grid)
        if grid is None:
            ctx = cls(None, None, 1, 0, 1, 0, vp_stage, None, 1, 1, config.expert_tp_size)
        else:
            ctx = cls(
                grid,
                grid.group("tp"),
                grid.size("tp"),
                grid.rank("tp"),
                grid.size("pp"),
                grid.rank("pp"),
                vp_stage,
                grid.layout.vpp,
                grid.size("cp"),
                grid.size("ep"),
                grid.size("etp"),
            )
        ctx.check(config)
        return ctx

    def check(self, config: TransformerConfig) -> None:
        pairs = (
            ("tensor_model_parallel_size", config.tensor_model_parallel_size, self.tp_size),
            ("pipeline_model_parallel_size", config.pipeline_model_parallel_size, self.pp_size),
            (
                "virtual_pipeline_model_parallel_size",
                config.virtual_pipeline_model_parallel_size,
                self.vpp if self.grid is not None else config.virtual_pipeline_model_parallel_size,
            ),
            ("context_parallel_size", config.context_parallel_size, self.cp_size),
            ("expert_model_parallel_size", config.expert_model_parallel_size, self.ep_size),
            ("expert_tensor_parallel_size", config.expert_tp_size, self.etp_size),
        )
        for name, want, got in pairs:
            if want != got:
                raise ModelConfigError(
                    f"{name}={want} but the grid has {got}; the rule: the config describes the "
                    f"grid the model is built on; fix: set {name}={got} (or build the grid "
                    f"with {want})"
                )
        self._check_hierarchical_cp(config)
        chunks = config.virtual_pipeline_model_parallel_size or 1
        if self.vp_stage is not None and not 0 <= self.vp_stage < chunks:
            raise ModelConfigError(
                f"vp_stage={self.vp_stage}: the rule: 0 <= vp_stage < "
                f"virtual_pipeline_model_parallel_size={chunks}; fix: build one chunk per stage"
            )
        if chunks > 1 and self.vp_stage is None:
            raise ModelConfigError(
                f"vp_stage=None with virtual_pipeline_model_parallel_size={chunks}: the rule: "
                "each chunk knows its virtual stage; fix: pass vp_stage=0..vpp-1 "
                "(or use build_model_chunks)"
            )

    def _check_hierarchical_cp(self, config: TransformerConfig) -> None:
        if config.cp_comm_type != "a2a+p2p" or self.cp_size == 1 or self.grid is None:
            return
        want = config.hierarchical_context_parallel_sizes
        got = self.grid.layout.hierarchical_cp
        if want is None or got is None or tuple(want) != tuple(got):
            raise ModelConfigError(
                f"cp_comm_type='a2a+p2p' with hierarchical_context_parallel_sizes={want} but "
                f"the grid's hierarchical_cp is {got}; the rule: the attention runs over the "
                "grid's hierarchical cp groups; fix: build the grid with "
                f"ParallelConfig(cp={self.cp_size}, hierarchical_cp={tuple(want or ())}) "
                "(or set the config's sizes to the grid's)"
            )

    @property
    def chunk(self) -> int:
        return self.vp_stage or 0

    def is_first_stage(self) -> bool:
        return self.pp_rank == 0 and self.chunk == 0

    def is_last_stage(self, chunks: int, placement: str = "loop") -> bool:
        """The chunk holding the output layer and the loss: the last rank's last chunk, or
        with the V placement (ZBV) rank 0's chunk 1."""
        if placement == "v":
            return self.pp_rank == 0 and self.chunk == 1
        return self.pp_rank == self.pp_size - 1 and self.chunk == chunks - 1

    def group(self, name: str) -> Any:
        """A grid group by name ("cp", "ep", "etp", "tp-cp", ...); None for one process."""
        return None if self.grid is None else self.grid.group(name)

    def rank(self, name: str) -> int:
        return 0 if self.grid is None else self.grid.rank(name)

    def embedding_group(self) -> Any:
        """The group of the first and last pipeline stage holding this rank (or None)."""
        if self.grid is None or not self.grid.in_embedding_group():
            return None
        return self.grid.group("embedding")


def _default_grid(grid: ProcessGrid | None) -> ProcessGrid | None:
    if grid is not None:
        return grid
    if model_parallel_is_initialized():
        return get_default_grid()
    if dist.is_initialized() and dist.get_world_size() > 1:
        raise ModelConfigError(
            "grid=None but torch.distributed runs with "
            f"{dist.get_world_size()} processes and no default grid; the rule: a model on "
            "several processes needs its process groups; fix: pass grid=initialize_model_parallel"
            "(ParallelConfig(...)) (or call it once to set the default grid)"
        )
    return None
