"""`FSDP2Optimizer` state under the keys of `optimizer_state`, so either engine loads the other's.

FSDP2's params are the fp32 main params and the inner optimizer's state is sharded like
them (`DTensor`s over dp x cp). Each rank writes, and on load reads, the rows it holds (see
`FSDP2DataParallel.held_rows`): `optim/main/<key>` from the param itself, `optim/<state>/<key>`
from the inner state, `optim/step` once. No collective beyond the step agreement: the
shards are already disjoint, where the distributed optimizer must first gather its pieces.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from pentatron.optim import FSDP2Optimizer, local_tensor
from pentatron.parallel_state import ProcessGrid

from .model_state import add_rect, iter_param_rects
from .optimizer_state import (
    PREFIX,
    STEP_KEY,
    global_step,
    load_groups,
    load_inner_state,
    per_element_keys,
    saved_has_state,
)


def fsdp2_optimizer_save_entries(
    optimizer: FSDP2Optimizer, chunks: Sequence[Any], grid: ProcessGrid
) -> dict[str, Any]:
    """Collective over the world (the step count): this rank's rows of the optimizer tensors."""
    step = global_step(optimizer)
    keys = per_element_keys(optimizer) if step.item() > 0 else []
    state = optimizer.optimizer.state
    sd: dict[str, Any] = {}
    if dist.get_rank() == 0:
        sd[STEP_KEY] = step
    for p, rects in iter_param_rects(chunks, grid):
        values = {"main": p.detach(), **{k: state[p][k] for k in keys}}
        for rect in rects:
            if rect.writer:
                for k, v in values.items():
                    add_rect(sd, f"{PREFIX}{k}/", rect, local_tensor(v))
    return sd


class FSDP2OptimizerLoad:
    """Receiving tensors for one load (`entries`, filled by DCP), then `apply()`.

    The main params land in their own buffers and are copied into the params after the read:
    the model entries fill the same params, and DCP's order of the two reads is not fixed.
    """

    def __init__(
        self,
        optimizer: FSDP2Optimizer,
        grid: ProcessGrid,
        saved: set[str],
        skip: frozenset[str] = frozenset(),
    ):
        """`skip`: rectangle keys not read (their values stay zero)."""
        self.optimizer = optimizer
        self.has_state = saved_has_state(saved)
        keys = per_element_keys(optimizer) if self.has_state else []
        self.entries: dict[str, Any] = {STEP_KEY: torch.zeros((), dtype=torch.float64)}
        self.main: dict[torch.nn.Parameter, torch.Tensor] = {}
        self.state: dict[torch.nn.Parameter, dict[str, torch.Tensor]] = {}
        for p, rects in iter_param_rects(optimizer.model_chunks, grid):
            self.main[p] = torch.zeros_like(local_tensor(p.data))
            self.state[p] = {k: torch.zeros_like(p.data) for k in keys}  # DTensors like p
            targets = {"main": self.main[p]}
            targets.update({k: local_tensor(v) for k, v in self.state[p].items()})
            for rect in (r for r in rects if r.key not in skip):
                for k, t in targets.items():
                    add_rect(self.entries, f"{PREFIX}{k}/", rect, t)

    @torch.no_grad()
    def apply(self, common: dict[str, Any]) -> None:
        for p, main in self.main.items():
            local_tensor(p.data).copy_(main)
        if self.has_state:
            step = self.entries[STEP_KEY].float()
            new_state = {p: {"step": step.clone(), **st} for p, st in self.state.items()}
            load_inner_state(self.optimizer.optimizer, new_state)
        load_groups(self.optimizer, common.get("param_groups", []))
