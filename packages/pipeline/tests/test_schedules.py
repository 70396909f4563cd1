"""Parity: every schedule gives the single-process losses and gradients (fp64, atol 1e-10),
runs the ops in the order derived from Megatron's rules, and sends what the closed form says.

Many cases run in one distributed call per world size; each rank compares its own chunks
with a reference it computes itself, and returns what the parent asserts on.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))

from _model import LAYERS, B, Chunk, H, S, build_blocks, make_loss, microbatches, reference

from pentatron.parallel_state import ParallelConfig, comm, initialize_model_parallel
from pentatron.pipeline import (
    PipelineConfig,
    PipelineConfigError,
    StageLayout,
    Timeline,
    get_forward_backward_func,
    v_stage,
)

ATOL = 1e-10  # fp64: pipelining reorders nothing inside a micro-batch, only accumulation order

# --- what a rank runs ------------------------------------------------------------------------


class _Recorder:
    """Recording hooks: no_sync state per grad accumulation, sync calls, finalize calls."""

    def __init__(self) -> None:
        self.inside = False
        self.log: list[tuple] = []
        self.finalize_tokens: list = []

    def no_sync(self):
        import contextlib

        @contextlib.contextmanager
        def ctx():
            self.inside = True
            try:
                yield
            finally:
                self.inside = False

        return ctx()


_LIVE: dict[tuple[int, int], int] = {}  # (micro-batch, chunk) -> saved tensors alive


class _Saved:
    """What saved_tensors_hooks packs: counts the tensors autograd keeps per (mb, chunk)."""

    def __init__(self, mb: tuple[int, int], t: torch.Tensor) -> None:
        self.mb, self.t = mb, t
        _LIVE[mb] = _LIVE.get(mb, 0) + 1

    def __del__(self) -> None:
        _LIVE[self.mb] -= 1


def _run_case(grid, case: dict) -> dict:
    pp, vpp, m = grid.size("pp"), case.get("vpp"), case["m"]
    v = vpp or 1
    rank = grid.rank("pp")
    variable, per_token = case.get("variable", False), case.get("per_token", False)
    layout = StageLayout(LAYERS, pp, vpp, stage_layers=case.get("stage_layers"))
    blocks = build_blocks()
    chunks = [Chunk(blocks, layout.layers(rank, c), rank == 0 and c == 0, c) for c in range(v)]
    rec = _Recorder()
    cache_flags = _probe_weight_cache(chunks)
    for chunk in chunks:
        first = next(chunk.parameters(), None)
        if first is None:  # an empty stage of a custom layout
            continue
        first.register_post_accumulate_grad_hook(
            lambda p, c=chunk.chunk: rec.log.append(("B", c, rec.inside))
        )

    def finalize(model_chunks, tokens):
        if tokens is not None:
            # As Megatron's finalize_model_grads: the last stage counted the tokens.
            tokens = tokens.clone()
            comm.broadcast(tokens, src=grid.ranks("pp")[-1], group=grid.group("pp"))
        rec.finalize_tokens.append(None if tokens is None else int(tokens))
        if tokens is not None:  # per-token mode: normalise once over the whole step
            for ch in model_chunks:
                for p in ch.parameters():
                    p.grad /= int(tokens)

    hooks = case.get("hooks", "plain")
    extra = {}
    if hooks == "sync":
        extra = dict(
            grad_sync_func=[(lambda params, c=c: rec.log.append(("sync", c))) for c in range(v)],
            param_sync_func=[(lambda params, c=c: rec.log.append(("psync", c))) for c in range(v)],
        )
    config = PipelineConfig(
        hidden_size=H,
        pipeline_dtype=torch.float64,
        batch_p2p_comm=case.get("batch", True),
        overlap_p2p_comm=case.get("overlap", False),
        deallocate_pipeline_outputs=case.get("dealloc", False),
        calculate_per_token_loss=per_token,
        variable_seq_lengths=variable,
        microbatch_group_size_per_vp_stage=case.get("group"),
        no_sync_func=rec.no_sync,
        finalize_model_grads_func=finalize,
        **extra,
    )
    data = microbatches(m, variable)
    storages: list = []
    peak = {"mbs": 0, "alive_outputs": 0}

    def forward_step(it, model):
        mb, (x, target, mask) = next(it)
        rec.log.append(("F", model.chunk))
        peak["alive_outputs"] = max(
            peak["alive_outputs"], sum(not torch.UntypedStorage._expired(w) for w in storages)
        )
        key = (mb, model.chunk)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: _Saved(key, t), lambda s: s.t):
            out = model(x)
        peak["mbs"] = max(peak["mbs"], sum(1 for n in _LIVE.values() if n > 0))
        last = rank == pp - 1 and model.chunk == v - 1
        if not last and out.grad_fn is not None:  # (an empty stage passes its input on)
            storages.append(out.untyped_storage()._weak_ref())
        return out, make_loss(target, mask, per_token)

    _LIVE.clear()
    timeline = Timeline(rank=rank)
    func = get_forward_backward_func(pp, vpp)
    forward_only = case.get("forward_only", False)
    with comm.trace() as ledger:
        reduced = func(
            forward_step_func=forward_step,
            data_iterator=[iter(enumerate(data)) for _ in range(v)],
            model=chunks,
            num_microbatches=m,
            seq_length=S,
            micro_batch_size=B,
            forward_only=forward_only,
            config=config,
            grid=grid,
            timeline=timeline,
        )
    ref_losses, ref_grads, ref_tokens = reference(m, variable, per_token)
    err = 0.0
    if not forward_only:
        for chunk in chunks:
            for i, block in zip(chunk.layers, chunk.blocks):
                err = max(
                    err,
                    (block.fc.weight.grad - ref_grads[i][0]).abs().max().item(),
                    (block.fc.bias.grad - ref_grads[i][1]).abs().max().item(),
                )
    losses = [float(r[0]) if per_token else float(r) for r in reduced]
    return {
        "rank": rank,
        "grad_err": err,
        "nparams": sum(len(c.layers) for c in chunks),
        "loss_err": max((abs(a - b) for a, b in zip(losses, ref_losses)), default=0.0)
        if losses
        else None,
        "nlosses": len(losses),
        "tokens": [int(r[1]) for r in reduced] if per_token else None,
        "ref_tokens": ref_tokens,
        "ops": [(o.kind, o.microbatch, o.chunk) for o in timeline.ops()],
        "sends": [(r.op, r.group, r.elements) for r in ledger.records if r.op in ("send", "recv")],
        "log": rec.log,
        "finalize": rec.finalize_tokens,
        "peak_mbs": peak["mbs"],
        "alive_outputs": peak["alive_outputs"],
        "cache_flags": cache_flags,
        "cache_after": [b.is_first_microbatch for c in chunks for b in c.blocks],
    }


def _probe_weight_cache(chunks) -> dict[int, list]:
    """Give every block the weight-cache protocol of TE's linears (`is_first_microbatch`:
    None outside a schedule; True: cast and cache, then set False; False: reuse) and record
    the flag each forward sees, per layer."""
    seen: dict[int, list] = {}
    for chunk in chunks:
        for layer, block in zip(chunk.layers, chunk.blocks):
            block.is_first_microbatch = None

            def probe(module, args, layer=layer):
                seen.setdefault(layer, []).append(module.is_first_microbatch)
                if module.is_first_microbatch:
                    module.is_first_microbatch = False

            block.register_forward_pre_hook(probe)
    return seen


def _run_cases(cases: list[dict]) -> list[dict]:
    world = dist.get_world_size()
    grids = {}
    out = []
    for case in cases:
        vpp = case.get("vpp")
        if vpp not in grids:
            grids[vpp] = initialize_model_parallel(ParallelConfig(pp=world, vpp=vpp))
        out.append(_run_case(grids[vpp], case))
    return out


# --- the closed forms the results are checked against -------------------------------------


def expected_table(m: int, v: int, g: int) -> list[tuple[int, int]]:
    """Virtual step k -> (microbatch, chunk), written per index: full groups of g*v steps
    (chunk-major inside a group), then a last group of the remaining q = m % g micro-batches."""
    full = m // g
    out = []
    for k in range(m * v):
        grp, within = divmod(k, g * v)
        if grp < full:
            out.append((grp * g + within % g, within // g))
        else:
            q = m - full * g
            rest = k - full * g * v
            out.append((full * g + rest % q, rest // q))
    return out


def expected_ops(p: int, r: int, m: int, v: int | None, g: int | None, forward_only: bool):
    vv = v or 1
    table = expected_table(m, vv, (g or p) if v else m)
    total = m * vv
    if forward_only:
        warm = total
    elif v is None:
        warm = min(p - r - 1, m)
    else:
        warm = min((p - r - 1) * 2 + (vv - 1) * (g or p), total)
    fwd = [("F", mb, c) for mb, c in table]
    bwd = [("B", mb, vv - 1 - c) for mb, c in table]
    ops = fwd[:warm]
    for k in range(total - warm):
        ops += [fwd[warm + k], bwd[k]]
    return ops + bwd[total - warm :] if not forward_only else ops


def check_case(case: dict, results: list[dict]) -> None:
    p = len(results)
    v, m = case.get("vpp"), case["m"]
    forward_only = case.get("forward_only", False)
    assert sum(r["nparams"] for r in results) == LAYERS
    for r in results:
        rank = r["rank"]
        assert r["grad_err"] <= ATOL, (case, rank, r["grad_err"])
        assert r["ops"] == expected_ops(p, rank, m, v, case.get("group"), forward_only), rank
        if rank == p - 1:
            assert r["nlosses"] == m and r["loss_err"] <= ATOL, (case, r["loss_err"])
        else:
            assert r["nlosses"] == 0
        if case.get("per_token") and rank == p - 1:
            assert sum(r["tokens"]) == r["ref_tokens"]
        if not forward_only:
            tokens = r["ref_tokens"] if case.get("per_token") else None
            assert r["finalize"] == [tokens]
        else:
            assert r["finalize"] == []
    if not case.get("variable"):
        check_ledger(case, results)


def check_weight_cache(case: dict, results: list[dict]) -> None:
    """Each layer casts its weights at its first micro-batch of the call and reuses them for
    the other m - 1; after the call no module is left reading a cache."""
    for r in results:
        assert len(r["cache_flags"]) == r["nparams"], r["rank"]
        for layer, flags in r["cache_flags"].items():
            assert flags == [True] + [False] * (case["m"] - 1), (case, r["rank"], layer)
        assert all(flag is None for flag in r["cache_after"]), (case, r["rank"])


def check_ledger(case: dict, results: list[dict]) -> None:
    """Each of the p*v-1 chunk boundaries carries m activations forward and (training) m
    grads backward, s*b*h elements each: so rank r sends m*v activations minus m on the last
    rank and m*v grads minus m on the first."""
    p, m, v = len(results), case["m"], case.get("vpp") or 1
    forward_only = case.get("forward_only", False)
    total_sends = 0
    for r in results:
        rank = r["rank"]
        sends = [x for x in r["sends"] if x[0] == "send"]
        recvs = [x for x in r["sends"] if x[0] == "recv"]
        assert {x[2] for x in r["sends"]} <= {S * B * H}
        fwd = m * v - (m if rank == p - 1 else 0)
        bwd = 0 if forward_only else m * v - (m if rank == 0 else 0)
        assert len(sends) == fwd + bwd, (case, rank, len(sends), fwd, bwd)
        fwd_in = m * v - (m if rank == 0 else 0)
        bwd_in = 0 if forward_only else m * v - (m if rank == p - 1 else 0)
        assert len(recvs) == fwd_in + bwd_in
        total_sends += len(sends)
    assert total_sends == (1 if forward_only else 2) * m * (p * v - 1)


def check_hooks(case: dict, results: list[dict]) -> None:
    """no_sync is active for every grad accumulation but the last of each chunk."""
    m = case["m"]
    for r in results:
        per_chunk: dict[int, list[bool]] = {}
        for entry in r["log"]:
            if entry[0] == "B":
                per_chunk.setdefault(entry[1], []).append(entry[2])
        for flags in per_chunk.values():
            assert flags == [True] * (m - 1) + [False]


def check_sync_hooks(case: dict, results: list[dict]) -> None:
    """Interleaved: each chunk's grad sync once after its last backward, param sync once
    before its first forward. 1F1B (as Megatron's): the first stage reduces through its
    enabled grad hooks during the last backward; every other stage calls grad_sync_func
    (given as a list of one, as the app does) once after its last backward; no param sync
    (the param gather runs in the forward pre-hooks)."""
    if case.get("vpp") is None:
        for r in results:
            log = r["log"]
            syncs = [i for i, e in enumerate(log) if e == ("sync", 0)]
            backs = [i for i, e in enumerate(log) if e[0] == "B"]
            assert not [e for e in log if e[0] == "psync"], (r["rank"], log)
            if r["rank"] == 0:
                assert syncs == [], log
            else:
                assert len(syncs) == 1 and syncs[0] > backs[-1], (r["rank"], log)
        return
    for r in results:
        log = r["log"]
        for c in range(case["vpp"]):
            syncs = [i for i, e in enumerate(log) if e == ("sync", c)]
            backs = [i for i, e in enumerate(log) if e[0] == "B" and e[1] == c]
            psyncs = [i for i, e in enumerate(log) if e == ("psync", c)]
            fwds = [i for i, e in enumerate(log) if e == ("F", c)]
            assert len(syncs) == 1 and syncs[0] > backs[-1], (r["rank"], c, log)
            assert len(psyncs) == 1 and psyncs[0] < fwds[0], (r["rank"], c)


# --- the cases --------------------------------------------------------------------------------


def _cases(p: int) -> list[dict]:
    cases = []
    for m in (p, 2 * p, 3 * p, p + 1):  # p + 1: not a multiple of p (allowed by 1F1B)
        cases.append(dict(m=m, batch=m % 2 == 0))
    cases += [
        dict(m=2 * p, forward_only=True),
        dict(m=2 * p, dealloc=True),
        dict(m=2 * p, per_token=True),
        dict(m=2 * p, variable=True, batch=False),
        dict(m=1),
        dict(m=2 * p, hooks="plain", batch=False),
        dict(m=2 * p, hooks="sync"),  # grad_sync_func as a one-chunk list
    ]
    for m in (p, 2 * p, 3 * p):
        cases.append(dict(m=m, vpp=2, batch=m != 2 * p))
    cases += [
        dict(m=2 * p, vpp=2, overlap=True, batch=False),
        dict(m=2 * p, vpp=2, overlap=True, batch=False, dealloc=True),
        dict(m=2 * p, vpp=2, forward_only=True),
        dict(m=2 * p + 1, vpp=2, group=p + 1),  # remainder p: allowed
        dict(m=3 * p, vpp=2, group=3 * p // 2 if p > 2 else 3),
        dict(m=2 * p, vpp=2, per_token=True, variable=True, batch=False),
        dict(m=2 * p, vpp=2, hooks="sync"),
    ]
    if p == 2:
        cases.append(dict(m=4, vpp=4))  # 8 layers over 2 x 4 chunks
    # custom layouts (Megatron's --pipeline-model-parallel-layout) with an empty middle
    # stage: it passes its input on and the grad back
    empty = (3, 0, 2, 3) if p == 2 else (2, 0, 1, 1, 0, 2, 1, 1)
    cases += [
        dict(m=2 * p, vpp=2, stage_layers=empty),
        dict(m=2 * p, vpp=2, stage_layers=empty, dealloc=True),
        dict(m=2 * p, vpp=2, stage_layers=empty, overlap=True, batch=False, dealloc=True),
    ]
    if p == 4:
        cases.append(dict(m=2 * p, stage_layers=(3, 0, 3, 2), dealloc=True))
    return cases


@pytest.mark.parametrize("world", [2, 4])
def test_schedules_match_single_process(distributed, world):
    cases = _cases(world)
    results = distributed.run(world, _run_cases, cases)
    for i, case in enumerate(cases):
        per_rank = [results[r][i] for r in range(world)]
        check_case(case, per_rank)
        check_weight_cache(case, per_rank)
        if case.get("hooks") == "sync":
            check_sync_hooks(case, per_rank)
        elif not case.get("forward_only"):
            check_hooks(case, per_rank)
        # (an empty stage of a custom layout saves nothing: the counts below assume layers)
        counted = not case.get("forward_only") and not case.get("stage_layers")
        if case.get("vpp") is None and counted:
            # 1F1B memory: rank r holds at most min(p - r, m) micro-batches' activations.
            for r in per_rank:
                assert r["peak_mbs"] == min(world - r["rank"], case["m"]), (case, r["rank"])
        if case.get("vpp") and counted:
            # Interleaved memory: rank r holds at most warm-up + 1 (micro-batch, chunk)
            # activations, warm-up = (p - r - 1) * 2 + (v - 1) * group, all m * v if larger.
            v, m, g = case["vpp"], case["m"], case.get("group") or world
            for r in per_rank:
                warm = (world - r["rank"] - 1) * 2 + (v - 1) * g
                assert r["peak_mbs"] == min(warm + 1, m * v), (case, r["rank"], r["peak_mbs"])
        if case.get("dealloc"):
            # Pseudo-freed outputs: no sent output's storage survives to the next forward
            # (interleaved with overlap: freed once its send was waited on, before then).
            assert all(r["alive_outputs"] == 0 for r in per_rank)
        if case == dict(m=2 * world, batch=True):
            # Control: without freeing, rank 0 keeps its warm-up outputs alive.
            assert per_rank[0]["alive_outputs"] >= 1


def _no_pipelining(m: int, forward_only: bool) -> dict:
    """pp = 1 on one rank: the same checks as above."""
    return _run_cases([dict(m=m, forward_only=forward_only)])[0]


@pytest.mark.parametrize("forward_only", [False, True])
def test_no_pipelining(distributed, forward_only):
    case = dict(m=3, forward_only=forward_only)
    (result,) = distributed.run(1, _no_pipelining, 3, forward_only)
    check_case(case, [result])
    check_weight_cache(case, [result])
    if not forward_only:
        check_hooks(case, [result])
        assert result["peak_mbs"] == 1  # one micro-batch's activations at a time


# --- bad input and failures ---------------------------------------------------------------------


def _bad_interleaved_call(m: int) -> str:
    grid = initialize_model_parallel(ParallelConfig(pp=2, vpp=2))
    blocks = build_blocks()
    chunks = [Chunk(blocks, range(0), False, c) for c in range(2)]
    config = PipelineConfig(hidden_size=H, pipeline_dtype=torch.float64)
    func = get_forward_backward_func(2, 2)
    with comm.trace() as ledger:
        try:
            func(
                forward_step_func=None,
                data_iterator=[iter([])] * 2,
                model=chunks,
                num_microbatches=m,
                seq_length=S,
                micro_batch_size=B,
                config=config,
                grid=grid,
            )
        except PipelineConfigError as exc:
            return f"{exc} | messages={len(ledger.records)}"
    return "no error"


def test_bad_microbatch_count_fails_before_any_message(distributed):
    for msg in distributed.run(2, _bad_interleaved_call, 3):
        assert "microbatch_group_size_per_vp_stage=2" in msg and "last group of 1" in msg
        assert "fix:" in msg and msg.endswith("messages=0")


def _stage_raises(schedule: str | None = None) -> str:
    grid = initialize_model_parallel(ParallelConfig(pp=2, timeout=timedelta(seconds=3)))
    rank = grid.rank("pp")
    if schedule == "zbv":  # the V: rank 0 holds stages 0 and 3, rank 1 stages 1 and 2
        per = LAYERS // 4
        stages = [v_stage(2, rank, c) for c in range(2)]
        blocks = build_blocks()
        chunks = [
            Chunk(blocks, range(s * per, (s + 1) * per), s == 0, c) for c, s in enumerate(stages)
        ]
    else:
        chunks = [Chunk(build_blocks(), StageLayout(LAYERS, 2).layers(rank), rank == 0, 0)]
    data = microbatches(4)
    calls = {"n": 0}

    def forward_step(it, model):
        calls["n"] += 1
        if rank == 1 and calls["n"] == 2:
            raise RuntimeError("stage 1 broke on micro-batch 1")
        x, target, mask = next(it)
        return model(x), make_loss(target, mask, False)

    store = None
    if schedule in ("zb-h1", "zbv"):
        from pentatron.tp_layers import WeightGradStore

        store = WeightGradStore()
    func = get_forward_backward_func(2, None, schedule)
    func(
        forward_step_func=forward_step,
        data_iterator=iter(data),
        model=chunks,
        num_microbatches=4,
        seq_length=S,
        micro_batch_size=B,
        grid=grid,
        config=PipelineConfig(hidden_size=H, pipeline_dtype=torch.float64, weight_grad_store=store),
    )
    return "finished"


@pytest.mark.parametrize("schedule", [None, "zb-h1", "zbv"])
def test_stage_that_raises_fails_every_rank(distributed, schedule):
    from pentatron.parallel_state.testing import RankError

    with pytest.raises(RankError) as info:
        distributed.run(2, _stage_raises, schedule)
    distributed.pool(2).close()  # abandoned gloo ops: start the next test afresh
    text = str(info.value)
    assert "rank(s) [0, 1]" in text
    assert "stage 1 broke on micro-batch 1" in text  # the failing rank, named with its error
    assert "CollectiveError" in text and "did not complete" in text  # its peer, not hung


def _interleaved_stage_raises() -> str:
    """p = 4, v = 2, m = 8: pipeline rank 2 raises in its first steady-state forward."""
    grid = initialize_model_parallel(ParallelConfig(pp=4, vpp=2, timeout=timedelta(seconds=2)))
    rank = grid.rank("pp")
    layout = StageLayout(LAYERS, 4, 2)
    blocks = build_blocks()
    chunks = [Chunk(blocks, layout.layers(rank, c), rank == 0 and c == 0, c) for c in range(2)]
    data = microbatches(8)
    warmup = (4 - rank - 1) * 2 + 4
    calls = {"n": 0}

    def forward_step(it, model):
        calls["n"] += 1
        if rank == 2 and calls["n"] == warmup + 1:
            raise RuntimeError("stage 2 broke in its steady state")
        x, target, mask = next(it)
        return model(x), make_loss(target, mask, False)

    get_forward_backward_func(4, 2)(
        forward_step_func=forward_step,
        data_iterator=[iter(data) for _ in range(2)],
        model=chunks,
        num_microbatches=8,
        seq_length=S,
        micro_batch_size=B,
        grid=grid,
        config=PipelineConfig(hidden_size=H, pipeline_dtype=torch.float64, batch_p2p_comm=False),
    )
    return "finished"


def test_interleaved_stage_that_raises_fails_every_rank(distributed):
    """Ranks not adjacent to the failing one fail too (their neighbours' groups go away),
    inside the harness's grace period, so every rank answers: RankError, not a timeout."""
    from pentatron.parallel_state.testing import RankError

    with pytest.raises(RankError) as info:
        distributed.run(4, _interleaved_stage_raises)
    text = str(info.value)
    assert "rank(s) [0, 1, 2, 3]" in text
    assert "stage 2 broke in its steady state" in text
    assert text.count("did not complete") >= 3  # ranks 0, 1 and 3: CollectiveError, not hung


@pytest.mark.parametrize(
    ("vpp", "schedule", "match"),
    [
        (3, "zbv", "two chunks per rank"),
        (None, "interleaved", "only it runs virtual stages"),
        (2, "zb-h1", "only it runs virtual stages"),
        (None, "gpipe", "one of 1f1b, interleaved, zb-h1, zbv"),
    ],
)
def test_a_schedule_that_does_not_fit_is_refused(vpp, schedule, match):
    with pytest.raises(PipelineConfigError, match=match):
        get_forward_backward_func(2, vpp, schedule)


@pytest.mark.parametrize(
    ("schedule", "nchunks", "match"),
    [
        ("zb-h1", 1, "weight_grad_store"),
        ("zbv", 2, "weight_grad_store"),
        ("zbv", 1, "two per rank"),
    ],
)
def test_zero_bubble_misuse_is_refused_before_any_message(schedule, nchunks, match):
    chunks = [Chunk(build_blocks(), range(LAYERS), True, c) for c in range(nchunks)]
    with comm.trace() as ledger, pytest.raises(PipelineConfigError, match=match):
        get_forward_backward_func(2, None, schedule)(
            forward_step_func=None,
            data_iterator=None,
            model=chunks,
            num_microbatches=4,
            seq_length=S,
            micro_batch_size=B,
            config=PipelineConfig(hidden_size=H),
        )
    assert ledger.records == []
