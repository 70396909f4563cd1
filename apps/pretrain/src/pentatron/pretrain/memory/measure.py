"""Measure one training step's memory on this rank: the ground truth for the calculator.

`measure(argv)` runs the real app (arguments, grid, model chunks, DDP, optimizer, the 1F1B /
interleaved schedule, one optimizer step) on random tokens and returns, for this rank:
- static bytes read off the tensors: params (unique storages, so the distributed
  optimizer's padded param buffer counts whole), grad buffers, fp32 main params that own
  their storage, optimizer state (Adam m, v and `step`);
- activation bytes saved for backward per micro-batch, from
  `torch.autograd.graph.saved_tensors_hooks` counting unique storages that are not
  parameters, sized when the micro-batch's forward ends (an output-discarding checkpoint
  frees a saved output within the forward: it counts 0), and their peak under the schedule: a micro-batch is live from its forward
  until the first of its saved tensors is unpacked (its backward starts);
- with FSDP2: static bytes read off the local shards, and the gathered params and their
  unsharded grads at their largest (`_GatheredSampler`).

Run inside an initialised process group (the test harness, or torchrun):
`torchrun --nproc-per-node 4 -m pentatron.pretrain.memory.measure --tensor-model-parallel-size 2 ...`
prints one JSON line per rank.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

__all__ = ["MeasuredMemory", "measure", "main"]


@dataclass
class MeasuredMemory:
    """What one rank held in one training step (bytes)."""

    rank: int
    pp_rank: int
    tp_rank: int
    dp_rank: int
    edp_rank: int
    dp_cp_rank: int  # rank in the dense grad buffer's group (dp x cp)
    num_parameters: int
    weights_bytes: int
    grads_bytes: int
    main_params_bytes: int
    optimizer_bytes: int
    activations_per_microbatch: list[int] = field(default_factory=list)
    peak_activations_bytes: int = 0
    peak_microbatches_in_flight: int = 0
    # FSDP2: the most bytes of gathered params and their unsharded grads held at once
    fsdp_gathered_peak_bytes: int = 0
    # zero-bubble schedules: each micro-batch's deferred weight gradients (the tensors its
    # W holds, per chunk-backward in order), and the peak of saved activations plus the
    # W's pending, sampled before each F, B and W
    wgrad_bytes_per_microbatch: list[int] = field(default_factory=list)
    peak_activations_and_wgrad_bytes: int = 0


class _SavedTensorLedger:
    """Attributes each saved tensor's storage to the micro-batch whose forward saved it."""

    def __init__(self, param_storages: set[int]) -> None:
        self.param_storages = param_storages
        self.per_mb: list[dict[int, int]] = []
        # the current forward's storages, sized when it ends: an output-discarding
        # checkpoint (mla_up_proj, moe_act) frees a saved storage within the forward
        self.pending: dict[int, Any] = {}
        self.current: int | None = None
        self.in_forward = False  # inside forward_step: an unpack there is a nested backward
        self.live: set[int] = set()
        self.peak, self.peak_count = 0, 0
        self.store: Any = None  # a zero-bubble schedule's WeightGradStore
        self.peak_with_store = 0

    def _finalize(self) -> None:
        """Size the current forward's saved storages as they are now (a discarded one: 0)."""
        if self.current is not None:
            for ptr, st in self.pending.items():
                self.per_mb[self.current][ptr] = st.nbytes()
        self.pending.clear()

    def start_forward(self) -> None:
        self._finalize()
        self._snapshot()
        self.per_mb.append({})
        self.current = len(self.per_mb) - 1
        self.live.add(self.current)

    def _snapshot(self) -> None:
        total = sum(sum(self.per_mb[m].values()) for m in self.live)
        if total > self.peak:
            self.peak = total
        self.peak_count = max(self.peak_count, len(self.live))
        if self.store is not None:
            self.peak_with_store = max(self.peak_with_store, total + self.store.pending_bytes())

    def watch_store(self, store: Any) -> list[int]:
        """Sample before each W too, and record each sealed group's bytes (returned)."""
        self.store, sealed = store, []
        close, run = store.close_group, store.run_oldest

        def close_group() -> None:
            sealed.append(sum(item.nbytes for item in store._open))
            close()

        def run_oldest() -> None:
            self._finalize()
            self._snapshot()
            run()

        store.close_group, store.run_oldest = close_group, run_oldest
        return sealed

    sampler: Any = None  # FSDP2's _GatheredSampler

    def pack(self, t: torch.Tensor) -> Any:
        if self.sampler is not None:
            self.sampler.sample()
        # Packs outside a forward are backward-time recomputation: transient, not counted.
        # A parameter saved for backward is a weight, not an activation (FSDP2's gathered
        # params are parameters whose storage is not the sharded one).
        if self.current is not None and not isinstance(t, torch.nn.Parameter):
            st = t.untyped_storage()
            ptr = st.data_ptr()
            # FSDP2: a view of a gathered param is saved too, and its storage is freed
            # after forward (an activation allocated there later would share its address)
            gathered = self.sampler.gathered if self.sampler is not None else set()
            if ptr not in self.param_storages and ptr not in gathered and st.nbytes() > 0:
                self.pending[ptr] = st
        return (self.current, t)

    def unpack(self, packed: Any) -> torch.Tensor:
        if self.sampler is not None:
            self.sampler.sample()
        mb, t = packed
        if self.in_forward:
            # A forward and backward nested in the model's forward (e.g. a kernel probe on
            # first use): not the schedule's backward, so the micro-batch stays recorded.
            return t
        self._finalize()
        self.current = None  # a backward is running: later packs are recomputation
        if mb in self.live:
            self._snapshot()  # loss_func's tensors were saved after forward_step returned
            self.live.discard(mb)
        return t


def _random_batches(args: Any, seed: int):
    """Endless micro-batches of uniform random tokens `[b, s]` (the same on every rank)."""
    g = torch.Generator().manual_seed(seed)
    b, s, v = args.micro_batch_size, args.seq_length, args.vocab_size
    pos = torch.arange(s).expand(b, s)
    while True:
        tokens = torch.randint(0, v, (b, s + 1), generator=g)
        yield {
            "tokens": tokens[:, :-1],
            "labels": tokens[:, 1:],
            "loss_mask": torch.ones(b, s),
            "position_ids": pos,
        }


def _local(t: torch.Tensor) -> torch.Tensor:
    from pentatron.optim.distributed.fsdp import local_tensor

    return local_tensor(t)


def _fsdp2_static_bytes(chunks, optimizer) -> dict[str, int]:
    """FSDP2: the sharded fp32 params (each padded to ceil(rows / d) rows), their grads
    (one flat buffer per FSDP unit), no separate main params, the local optimizer state."""
    params = [p for c in chunks for p in c.module.parameters()]
    storages = {}
    grads = {}
    for p in params:
        st = _local(p).untyped_storage()
        storages[st.data_ptr()] = st.nbytes()
        if p.grad is not None:
            gst = _local(p.grad).untyped_storage()
            grads[gst.data_ptr()] = gst.nbytes()
    return {
        "num_parameters": sum(p.numel() for p in params),
        "weights_bytes": sum(storages.values()),
        "grads_bytes": sum(grads.values()),
        "main_params_bytes": 0,
        "optimizer_bytes": _optimizer_state_bytes(optimizer),
    }


def _optimizer_state_bytes(optimizer) -> int:
    """The inner optimizer's state tensors (FSDP2's: their local shards)."""
    return sum(
        _local(v).nbytes
        for s in optimizer.optimizer.state.values()
        for v in s.values()
        if torch.is_tensor(v)
    )


class _GatheredSampler:
    """FSDP2's gathered state at its largest: the all-gathered params allocated now (one
    padded `[d ceil(rows/d), ...]` buffer each, compute dtype; a unit prefetched and not
    yet copied out: its flat all-gather output) plus the unsharded grads
    held (the compute dtype's, and any kept for a deferred reduce-scatter), summed over
    every unit. Sampled at each saved tensor's pack and unpack and after each gathered
    param's grad is accumulated (the moment before FSDP2 reduce-scatters a unit's grads),
    through FSDP2's private state (`FSDPParam`), read-only."""

    def __init__(self, chunks) -> None:
        from torch.distributed.fsdp import FSDPModule

        self.params, self.groups = [], []
        for c in chunks:
            for m in c.module.modules():
                if isinstance(m, FSDPModule):
                    group = m._get_fsdp_state()._fsdp_param_group
                    if group is not None:
                        self.groups.append(group)
                        self.params += list(group.fsdp_params)
        self.hooked: set[int] = set()
        self.handles: list[Any] = []
        self.peak = 0
        self.gathered: set[int] = set()  # storages of the params gathered now

    def close(self) -> None:
        """Drop the hooks and FSDP2's objects: a hook on a param that holds this sampler
        is a reference cycle, which kept the groups (their gloo threads) alive."""
        for handle in self.handles:
            handle.remove()
        self.handles, self.params, self.groups = [], [], []

    def sample(self, *_: Any) -> None:
        # a prefetched unit's all-gather, not yet copied out to its params' buffers
        total = sum(
            g._all_gather_result.all_gather_output.untyped_storage().nbytes()
            for g in self.groups
            if g._all_gather_result is not None
        )
        self.gathered = set()
        for fp in self.params:
            for t in fp.all_gather_outputs:
                st = t.untyped_storage()
                if st.nbytes():
                    total += st.nbytes()
                    self.gathered.add(st.data_ptr())
            unsharded = getattr(fp, "_unsharded_param", None)
            if unsharded is not None:
                if id(unsharded) not in self.hooked:
                    self.hooked.add(id(unsharded))
                    hook = unsharded.register_post_accumulate_grad_hook(self.sample)
                    self.handles.append(hook)
                if unsharded.grad is not None:
                    total += unsharded.grad.untyped_storage().nbytes()
            if fp.unsharded_accumulated_grad is not None:
                total += fp.unsharded_accumulated_grad.untyped_storage().nbytes()
        self.peak = max(self.peak, total)


def _static_bytes(chunks, optimizer) -> dict[str, int]:
    if not hasattr(chunks[0], "all_buffers"):
        return _fsdp2_static_bytes(chunks, optimizer)
    params = [p for c in chunks for p in c.module.parameters()]
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in params}
    grads = sum(b.grad_data.nbytes for c in chunks for b in c.all_buffers)
    mains = sum(mp.main.nbytes for mp in optimizer.main_params if mp.owns_storage)
    state = _optimizer_state_bytes(optimizer)
    return {
        "num_parameters": sum(p.numel() for p in params),
        "weights_bytes": sum(storages.values()),
        "grads_bytes": grads,
        "main_params_bytes": mains,
        "optimizer_bytes": state,
    }


def _args_for(argv: list[str], world_size: int):
    from ..arguments import parse_args, validate_args

    base = ["--mock-data", "--train-iters", "1", "--device", "cpu"]
    args = validate_args(parse_args(base + list(argv)), world_size)
    args.vocab_size = args.vocab_size or 256
    return args


def measure(argv: list[str]) -> MeasuredMemory:
    """One training step of the app with `argv` (pentatron-pretrain flags) on this rank."""
    import torch.distributed as dist

    from pentatron.parallel_state import destroy_model_parallel

    from .. import pretrain_gpt
    from ..gpt_step import make_forward_step
    from ..training import configs, setup, step

    args = _args_for(argv, dist.get_world_size())
    grid = setup.initialize(args)
    try:
        provider = lambda pre, post, vp_stage=None: pretrain_gpt.model_provider(  # noqa: E731
            args, grid, args.vocab_size, pre, post, vp_stage
        )
        chunks, optimizer, _ = setup.setup_model_and_optimizer(provider, args, grid)
        iters = setup.build_iterators(lambda: _random_batches(args, args.seed), args, grid)
        storages = {
            _local(p).untyped_storage().data_ptr() for c in chunks for p in c.module.parameters()
        }
        ledger = _SavedTensorLedger(storages)
        fsdp2 = not hasattr(chunks[0], "all_buffers")
        ledger.sampler = _GatheredSampler(chunks) if fsdp2 else None
        inner = make_forward_step(grid, args.micro_batch_size, args.seq_length)

        def forward_step(data_iterator, model):
            ledger.start_forward()
            ledger.in_forward = True
            try:
                return inner(data_iterator, model)
            finally:
                ledger.in_forward = False

        pcfg = step.make_pipeline_config(args, chunks, grid, configs.pipeline_config, optimizer)
        store = getattr(pcfg, "weight_grad_store", None)
        sealed = ledger.watch_store(store) if store is not None else []
        with torch.autograd.graph.saved_tensors_hooks(ledger.pack, ledger.unpack):
            step.train_step(
                args, chunks, iters, forward_step, optimizer, pcfg, grid, args.num_microbatches
            )
        ledger._finalize()  # a forward-only last stage has no unpack to end it
        ledger._snapshot()
        if ledger.sampler is not None:
            ledger.sampler.close()
        static = _static_bytes(chunks, optimizer)
        return MeasuredMemory(
            rank=dist.get_rank(),
            pp_rank=grid.rank("pp"),
            tp_rank=grid.rank("tp"),
            dp_rank=grid.rank("dp"),
            edp_rank=grid.rank("edp"),
            dp_cp_rank=grid.rank("dp-cp"),
            activations_per_microbatch=[sum(m.values()) for m in ledger.per_mb],
            peak_activations_bytes=ledger.peak,
            peak_microbatches_in_flight=ledger.peak_count,
            fsdp_gathered_peak_bytes=ledger.sampler.peak if fsdp2 else 0,
            wgrad_bytes_per_microbatch=sealed,
            peak_activations_and_wgrad_bytes=ledger.peak_with_store,
            **static,
        )
    finally:
        destroy_model_parallel()


def main(argv: list[str] | None = None) -> int:
    """torchrun entry: print this rank's MeasuredMemory as one JSON line."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    result = measure(sys.argv[1:] if argv is None else argv)
    print(json.dumps(asdict(result)), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
