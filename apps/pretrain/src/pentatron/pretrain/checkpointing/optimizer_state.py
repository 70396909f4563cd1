"""Optimizer state as chunks of global tensors, reloadable at any tp / pp / dp layout.

Keys: `optim/main/<key>` (fp32 main params), `optim/<state>/<key>` for each per-element
state of the inner optimizer (Adam: `exp_avg`, `exp_avg_sq`), `optim/step` (the step
count, a scalar shared by all params); `<key>` as in `rectangles`. Param-group
hyperparameters and the loss scaler are small JSON (`common_state`).

With the distributed optimizer a dp rank holds flat pieces `[a, b)` of each param. Save:
per grad buffer, `flat[n]` (zeros outside this rank's pieces) -> all-reduce(dp, or edp for
the expert buffers) -> every param's full tp shard, written by dp (edp) rank 0. Load: every rank reads its full tp
shards and keeps the pieces it owns under the new layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from pentatron.optim import MixedPrecisionOptimizer
from pentatron.parallel_state import ProcessGrid, comm, current_device

from .model_state import add_rect, iter_param_rects

PREFIX = "optim/"
STEP_KEY = PREFIX + "step"
Pieces = dict[torch.nn.Parameter, list[tuple[int, Any]]]  # param -> [(offset, MainParam)]


def per_element_keys(optimizer: MixedPrecisionOptimizer) -> list[str]:
    """The inner optimizer's per-element state names (equal on every rank)."""
    inner = optimizer.optimizer
    if isinstance(inner, torch.optim.SGD):
        return ["momentum_buffer"] if any(g.get("momentum", 0) for g in inner.param_groups) else []
    keys = ["exp_avg", "exp_avg_sq"]  # torch Adam/AdamW, apex FusedAdam
    if any(g.get("amsgrad", False) for g in inner.param_groups):
        keys.append("max_exp_avg_sq")
    return keys


def _pieces(optimizer: MixedPrecisionOptimizer) -> Pieces:
    """Where each MainParam starts in its param's flat range (its target views the param)."""
    out: Pieces = {}
    for mp in optimizer.main_params:
        param, target = mp.model_param.data, mp.target
        offset = target.storage_offset() - param.storage_offset()
        assert offset >= 0 and offset + target.numel() <= param.numel(), (offset, param.shape)
        out.setdefault(mp.model_param, []).append((offset, mp))
    return out


def global_step(optimizer: Any) -> torch.Tensor:
    """The largest step count on any rank (0 before the first step): all-reduce(MAX, world)."""
    inner = optimizer.optimizer
    steps = [float(s["step"]) for s in inner.state.values() if "step" in s]
    params = [p for g in inner.param_groups for p in g["params"]]
    device = params[0].device if params else current_device()
    step = torch.tensor(max(steps, default=0.0), dtype=torch.float64, device=device)
    comm.all_reduce(step, op=dist.ReduceOp.MAX)  # a device tensor: nccl reduces no CPU ones
    return step.cpu()


@torch.no_grad()
def _full_shards(optimizer: MixedPrecisionOptimizer, keys: list[str]):
    """`{param: {key: fp32 [param shape]}}`: the full tp shard of each state (see module)."""
    pieces, state = _pieces(optimizer), optimizer.optimizer.state
    out: dict[torch.nn.Parameter, dict[str, torch.Tensor]] = {}
    for chunk in optimizer.model_chunks:
        for buffer in chunk.all_buffers:
            n = buffer.grad_data.numel()
            flats = {k: torch.zeros(n, device=buffer.grad_data.device) for k in keys}
            for p in buffer.params:
                base = buffer.param_range[p][0]
                for offset, mp in pieces.get(p, []):
                    lo, hi = base + offset, base + offset + mp.main.numel()
                    values = {"main": mp.main, **state.get(mp.main, {})}
                    for k in keys:
                        if k in values:
                            flats[k][lo:hi] = values[k].reshape(-1)
            if optimizer.is_sharded:
                for k in keys:
                    comm.all_reduce(flats[k], group=buffer.dp_group)
            for p in buffer.params:
                start, end = buffer.param_range[p]
                out[p] = {k: flats[k][start:end].view(p.shape) for k in keys}
    return out


def optimizer_save_entries(
    optimizer: MixedPrecisionOptimizer, chunks: Sequence[Any], grid: ProcessGrid
) -> dict[str, Any]:
    """Collective over the world: this rank's chunks of the optimizer tensors."""
    step = global_step(optimizer)
    keys = ["main"] + (per_element_keys(optimizer) if step.item() > 0 else [])
    full = _full_shards(optimizer, keys)
    sd: dict[str, Any] = {}
    if dist.get_rank() == 0:
        sd[STEP_KEY] = step
    for p, rects in iter_param_rects(chunks, grid):
        for rect in rects:
            if rect.writer:
                for k in keys:
                    add_rect(sd, f"{PREFIX}{k}/", rect, full[p][k])
    return sd


def saved_has_state(saved: set[str]) -> bool:
    """Did the checkpoint hold per-element optimizer state (saved after a first step)?"""
    return STEP_KEY in saved and any(
        k.startswith(PREFIX + "exp_avg/") or k.startswith(PREFIX + "momentum_buffer/")
        for k in saved
    )


class OptimizerLoad:
    """Receiving tensors for one load (`entries`), then `apply()` puts them in place."""

    def __init__(
        self,
        optimizer: MixedPrecisionOptimizer,
        grid: ProcessGrid,
        saved: set[str],
        skip: frozenset[str] = frozenset(),
    ):
        """`skip`: rectangle keys not read (their values stay zero)."""
        self.optimizer, self.pieces = optimizer, _pieces(optimizer)
        self.has_state = saved_has_state(saved)
        self.keys = ["main"] + (per_element_keys(optimizer) if self.has_state else [])
        self.full: dict[torch.nn.Parameter, dict[str, torch.Tensor]] = {}
        self.entries: dict[str, Any] = {STEP_KEY: torch.zeros((), dtype=torch.float64)}
        for p, rects in iter_param_rects(optimizer.model_chunks, grid):
            if p not in self.pieces:
                continue  # the distributed optimizer gave this rank no piece of p
            self.full[p] = {k: torch.zeros(p.shape, device=p.device) for k in self.keys}
            for rect in (r for r in rects if r.key not in skip):
                for k in self.keys:
                    add_rect(self.entries, f"{PREFIX}{k}/", rect, self.full[p][k])

    @torch.no_grad()
    def apply(self, common: dict[str, Any]) -> None:
        """Main params, inner state, group hyperparameters, loss scaler; then the model."""
        step = self.entries[STEP_KEY].float()
        new_state: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
        for p, pieces in self.pieces.items():
            for offset, mp in pieces:
                n = mp.main.numel()
                part = {
                    k: t.view(-1)[offset : offset + n].view_as(mp.main)
                    for k, t in self.full[p].items()
                }
                mp.main.copy_(part.pop("main"))
                if self.has_state:
                    new_state[mp.main] = {
                        "step": step.clone(),
                        **{k: v.clone() for k, v in part.items()},
                    }
        load_inner_state(self.optimizer.optimizer, new_state)
        load_groups(self.optimizer, common.get("param_groups", []))
        scaler = self.optimizer.grad_scaler
        if scaler is not None and common.get("grad_scaler") is not None:
            scaler.load_state_dict(common["grad_scaler"])
        write_main_to_model(self.optimizer)


def load_inner_state(inner: torch.optim.Optimizer, new_state: dict) -> None:
    """Through `load_state_dict`, so torch casts and places `step` as it expects."""
    current = inner.state_dict()
    params = [t for g in inner.param_groups for t in g["params"]]
    state = {i: new_state[t] for i, t in enumerate(params) if t in new_state}
    inner.load_state_dict({"state": state, "param_groups": current["param_groups"]})


@torch.no_grad()
def write_main_to_model(optimizer: MixedPrecisionOptimizer) -> None:
    """Model params <- fp32 main params (rounded to the model dtype), for owned pieces."""
    for mp in optimizer.main_params:
        if mp.owns_storage:
            mp.target.copy_(mp.main.view_as(mp.target))


@torch.no_grad()
def refresh_main_from_model(optimizer: MixedPrecisionOptimizer) -> None:
    """Main params <- the (just loaded) model params, when the optimizer is not loaded."""
    for mp in optimizer.main_params:
        if mp.owns_storage:
            mp.main.copy_(mp.target.view_as(mp.main).float())


def _numeric(value: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float, list, tuple)):
        return None
    if isinstance(value, (list, tuple)):
        ok = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
        return list(value) if ok else None
    return value


def groups_state(optimizer: MixedPrecisionOptimizer) -> list[dict[str, Any]]:
    """Numeric hyperparameters of each param group (JSON), keyed by wd_mult / lr_mult."""
    out = []
    for g in optimizer.optimizer.param_groups:
        entry = {k: _numeric(v) for k, v in g.items() if k != "params"}
        out.append({k: v for k, v in entry.items() if v is not None})
    return out


def load_groups(optimizer: MixedPrecisionOptimizer, saved: list[dict[str, Any]]) -> None:
    """Groups are matched by (wd_mult, lr_mult): another layout may order them otherwise."""
    by_key = {(s.get("wd_mult", 1.0), s.get("lr_mult", 1.0)): s for s in saved}
    for g in optimizer.optimizer.param_groups:
        s = by_key.get((g.get("wd_mult", 1.0), g.get("lr_mult", 1.0)))
        for k, v in (s or {}).items():
            if k in g and _numeric(g[k]) is not None:
                g[k] = type(g[k])(v)  # a tuple stays a tuple (betas), an int an int
