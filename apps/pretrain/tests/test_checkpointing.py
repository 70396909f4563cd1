"""Checkpoints of the training app: round trip, resharding, atomic publish, keep-last.

A tiny GPT (4 layers, hidden 32, SwiGLU, tied embeddings, fp32) starts from one
single-process state at every layout. It trains 2 steps at tp2-pp2-dp2 with the
distributed optimizer and saves; the reference continues 2 more steps there. Loading at
the same layout reproduces params, optimizer state, scheduler, RNG and the next losses bit
for bit; at tp4-pp2-dp1, tp1-pp1-dp4 (plain optimizer) and tp1-pp2-vpp2-dp2 the next two
losses match within fp32 reordering (`TOL`); the second loss checks the loaded Adam state.
A checkpoint saved without the distributed optimizer (tp1-dp4) resumes at tp2-dp2 with it;
the local spec's checkpoint resumes in the TE spec's layout (norms fused into the linears,
PyTorch backend) at tp2-pp2-dp1;
bf16 params keep their fp32 main params. `test_lifecycle`: no checkpoint, keep_last, a save
killed after the DCP write, finetune, an incompatible config. `test_rectangles_*`: the tp
shards' rectangles tile every global tensor (vocabulary padding included).
"""

from __future__ import annotations

import os
import random
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from _ckpt_setup import TOL, build_run, full_state, make_grid, one_loss, tiny_config, train_step

from pentatron.models import get_gpt_layer_te_spec
from pentatron.parallel_state import comm, destroy_model_parallel
from pentatron.pretrain import checkpointing as ckpt
from pentatron.pretrain.checkpointing import save as save_module
from pentatron.tp_layers import get_rng_tracker

ARGS = {"micro_batch_size": 1, "lr": 0.01, "seed": 1234}


def _save(run, root, iteration, **kw):
    return ckpt.save_checkpoint(
        root,
        iteration,
        run.chunks,
        run.optimizer,
        run.scheduler,
        grid=run.grid,
        config=run.config,
        consumed_samples=8 * iteration,
        args=ARGS,
        **kw,
    )


def _load(run, root, **kw):
    return ckpt.load_checkpoint(
        root, run.chunks, run.optimizer, run.scheduler, grid=run.grid, config=run.config, **kw
    )


def _snapshot(run):
    """Params, fp32 main params, Adam state and scheduler of this rank (copies)."""
    opt = run.optimizer
    state = opt.optimizer.state
    return {
        "params": [p.detach().clone() for c in run.chunks for p in c.module.parameters()],
        "mains": [mp.main.detach().clone() for mp in opt.main_params],
        "adam": [{k: v.clone() for k, v in state[mp.main].items()} for mp in opt.main_params],
        "groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
        "scheduler": run.scheduler.state_dict(),
    }


def _rng_states():
    np_state = np.random.get_state()
    return (
        torch.get_rng_state(),
        random.getstate(),
        (np_state[0], torch.from_numpy(np_state[1].astype("int64")), *np_state[2:]),
        get_rng_tracker().get_states(),
    )


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def _tied_equal(run) -> bool | None:
    """On a rank holding a tied copy: does it equal the other stage's (all-reduce check)?"""
    for c in run.chunks:
        m = c.module
        if m.pre_process != m.post_process and m.share_embeddings_and_output_weights:
            w = m.shared_embedding_or_output_weight().detach().clone()
            total = w.clone()
            comm.all_reduce(total, group=m.parallel.embedding_group())
            return torch.equal(total, 2 * w)
    return None


def save_at_tp2_pp2_dp2(root, states):
    """World 8: train, save at iteration 2, continue (reference); reload at the same
    layout and at tp4-pp2-dp1."""
    grid = make_grid(2, 2, None)
    run = build_run(grid, states[0], dist_opt=True)
    for step in range(2):
        train_step(run, step)
    path = _save(run, root, 2)
    listing = sorted(os.listdir(root))
    saved, rng = _snapshot(run), _rng_states()
    ref = [train_step(run, step) for step in (2, 3)]
    torch.rand(3), random.random(), np.random.rand()  # the load must restore these
    with get_rng_tracker().fork():
        torch.rand(3)

    fresh = build_run(grid, states[1], dist_opt=True)
    loaded = _load(fresh, root)
    out = {
        "path": path,
        "listing": listing,
        "loaded": loaded,
        "same_state": _equal(_snapshot(fresh), saved),
        "same_rng": _equal(_rng_states(), rng),
        "tied_equal": _tied_equal(fresh),
        "ref": ref,
        "same_layout": [train_step(fresh, step) for step in (2, 3)],
    }
    destroy_model_parallel(grid)
    grid = make_grid(4, 2, None)
    run = build_run(grid, states[1], dist_opt=True)
    _load(run, root)
    out["tp4_pp2_dp1"] = [train_step(run, step) for step in (2, 3)]
    destroy_model_parallel(grid)
    return out


def load_at_world4(root, states):
    """World 4: tp1-pp1-dp4 (plain optimizer) and tp1-pp2-vpp2-dp2 (distributed); the plain
    run saves again (iteration 3) and tp2-pp1-dp2 (distributed) resumes from it."""
    out = {}
    grid = make_grid(1, 1, None)
    run = build_run(grid, states[1], dist_opt=False)
    out["loaded"] = _load(run, root)
    mains_are_params = all(torch.equal(mp.main, mp.target) for mp in run.optimizer.main_params)
    out["tp1_pp1_dp4"] = [train_step(run, 2)]
    _save(run, os.path.join(root, "plain"), 3)
    out["tp1_pp1_dp4"].append(train_step(run, 3))
    out["mains_are_params"] = mains_are_params
    destroy_model_parallel(grid)

    grid = make_grid(1, 2, 2)
    run = build_run(grid, states[1], dist_opt=True)
    _load(run, root)
    out["tied_equal"] = _tied_equal(run)
    out["tp1_pp2_vpp2_dp2"] = [train_step(run, step) for step in (2, 3)]
    destroy_model_parallel(grid)

    grid = make_grid(2, 1, None)
    run = build_run(grid, states[0], dist_opt=True)
    out["from_plain"] = _load(run, os.path.join(root, "plain"))
    out["from_plain_loss"] = train_step(run, 3)
    out["bf16"] = _bf16_round_trip(grid, os.path.join(root, "bf16"), states)
    destroy_model_parallel(grid)

    grid = make_grid(2, 2, None)  # the TE spec's layout (norms fused into the linears)
    run = build_run(grid, states[1], dist_opt=True, spec=get_gpt_layer_te_spec(backend="torch"))
    _load(run, root)
    fused = [n for c in run.chunks for n, _ in c.module.named_parameters() if "layer_norm_" in n]
    out["te_layout_fused_norms"] = len(fused)
    out["tp2_pp2_dp1_te_layout"] = [train_step(run, step) for step in (2, 3)]
    destroy_model_parallel(grid)
    return out


def _bf16_round_trip(grid, root, states):
    """bf16 params, fp32 main params (distributed): both survive, params = round(main)."""
    run = build_run(grid, states[0], dist_opt=True, bf16=True)
    for step in range(2):  # the first step has lr 0 (warm-up from init_lr=0)
        train_step(run, step)
    _save(run, root, 1)
    fresh = build_run(grid, states[1], dist_opt=True, bf16=True)
    _load(fresh, root)
    got, want = _snapshot(fresh), _snapshot(run)
    rounded = all(
        torch.equal(mp.target, mp.main.to(torch.bfloat16).view_as(mp.target))
        for mp in fresh.optimizer.main_params
    )
    exact = not all(
        torch.equal(mp.main, mp.main.bfloat16().float()) for mp in fresh.optimizer.main_params
    )
    return {"same_state": _equal(got, want), "rounded": rounded, "mains_not_bf16": exact}


@pytest.fixture(scope="module")
def resharded(distributed, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ckpt"))
    states = [full_state(tiny_config(), seed) for seed in (0, 1)]
    first = distributed.run(8, save_at_tp2_pp2_dp2, root, states)
    second = distributed.run(4, load_at_world4, root, states)
    return root, first, second


def test_same_layout_round_trip_is_exact(resharded):
    root, first, _ = resharded
    assert ckpt.read_latest_iteration(root) == 2
    for r in first:
        assert r["listing"] == ["iter_0000002", "latest_checkpointed_iteration.txt"]
        assert r["path"] == os.path.join(root, "iter_0000002")
        assert r["loaded"] == ckpt.LoadedCheckpoint(2, 16, ARGS)
        assert r["same_state"] and r["same_rng"]
        assert r["tied_equal"] in (None, True)
    ref = [one_loss([r["ref"][i] for r in first]) for i in range(2)]
    got = [one_loss([r["same_layout"][i] for r in first]) for i in range(2)]
    assert got == ref  # bitwise on CPU


@pytest.mark.parametrize(
    "key", ["tp4_pp2_dp1", "tp1_pp1_dp4", "tp1_pp2_vpp2_dp2", "tp2_pp2_dp1_te_layout"]
)
def test_resharded_load_continues_the_run(resharded, key):
    _, first, second = resharded
    ref = torch.tensor([one_loss([r["ref"][i] for r in first]) for i in range(2)])
    ranks = first if key == "tp4_pp2_dp1" else second
    got = torch.tensor([one_loss([r[key][i] for r in ranks]) for i in range(2)])
    torch.testing.assert_close(got, ref, **TOL)


def test_resharded_load_keeps_invariants(resharded):
    _, _, second = resharded
    for r in second:
        assert r["loaded"] == ckpt.LoadedCheckpoint(2, 16, ARGS)
        assert r["mains_are_params"]
        assert r["tied_equal"] in (None, True)
        assert r["from_plain"].iteration == 3
        assert r["te_layout_fused_norms"] == 2 * 2  # 2 layers a stage, 2 norms each
        assert r["bf16"] == {"same_state": True, "rounded": True, "mains_not_bf16": True}
    assert any(r["tied_equal"] for r in second)  # the pp2 run has tied copies
    # saved without the distributed optimizer at tp1-dp4, resumed at tp2-dp2 with it
    ref = one_loss([r["tp1_pp1_dp4"][1] for r in second])
    got = one_loss([r["from_plain_loss"] for r in second])
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), **TOL)


class _CrashAtBarrier:
    """Stands in for `comm` in the save module: every rank raises at barrier `n` (the one
    after the DCP write, before the folder is renamed), as if the job were killed there."""

    def __init__(self, n: int) -> None:
        self.n, self.calls = n, 0

    def barrier(self, group=None) -> None:
        self.calls += 1
        if self.calls == self.n:
            raise RuntimeError("simulated crash")
        comm.barrier(group)


def lifecycle(root, states):
    """World 4 at tp2-pp2: no checkpoint, keep_last, an interrupted save, finetune and an
    incompatible config."""
    grid = make_grid(2, 2, None)
    run = build_run(grid, states[0], dist_opt=True)
    out = {"empty": _load(run, root), "empty_latest": ckpt.read_latest_iteration(root)}
    for step in range(3):
        train_step(run, step)
        _save(run, root, step + 1, keep_last=2)
    out["after_keep"] = sorted(os.listdir(root))
    saved = _snapshot(run)
    train_step(run, 3)
    real = save_module.comm
    save_module.comm = _CrashAtBarrier(2)
    try:
        _save(run, root, 4)
    except RuntimeError as e:
        out["crash"] = str(e)
    finally:
        save_module.comm = real
    comm.barrier()
    out["after_crash"] = sorted(os.listdir(root))
    fresh = build_run(grid, states[1], dist_opt=True)
    out["resumed"] = _load(fresh, root)
    out["resumed_state"] = _equal(_snapshot(fresh), saved)

    tuned = build_run(grid, states[1], dist_opt=True)
    out["finetune"] = _load(tuned, root, finetune=True)
    out["finetune_params"] = _equal(_snapshot(tuned)["params"], saved["params"])
    out["finetune_mains"] = _equal(_snapshot(tuned)["mains"], saved["mains"])
    out["finetune_fresh_optim"] = not any(tuned.optimizer.optimizer.state.values())
    out["finetune_scheduler"] = tuned.scheduler.num_steps
    _save(run, root, 4)
    out["after_resave"] = sorted(os.listdir(root))

    other = build_run(grid, None, dist_opt=True, ffn_hidden_size=128)
    try:
        _load(other, root)
    except ckpt.IncompatibleCheckpointError as e:
        out["incompatible"] = str(e)
    destroy_model_parallel(grid)
    return out


def test_lifecycle(distributed, tmp_path):
    root = str(tmp_path / "run")
    states = [full_state(tiny_config(), seed) for seed in (0, 1)]
    for out in distributed.run(4, lifecycle, root, states):
        assert out["empty"] is None and out["empty_latest"] is None
        latest = "latest_checkpointed_iteration.txt"
        assert out["after_keep"] == ["iter_0000002", "iter_0000003", latest]
        assert out["crash"] == "simulated crash"
        assert out["after_crash"] == ["iter_0000002", "iter_0000003", "iter_0000004.tmp", latest]
        assert out["resumed"] == ckpt.LoadedCheckpoint(3, 24, ARGS) and out["resumed_state"]
        assert out["finetune"] == ckpt.LoadedCheckpoint(0, 0, ARGS)
        assert out["finetune_params"] and out["finetune_mains"] and out["finetune_fresh_optim"]
        assert out["finetune_scheduler"] == 0
        assert out["after_resave"] == ["iter_0000002", "iter_0000003", "iter_0000004", latest]
        assert "ffn_hidden_size=64" in out["incompatible"]
        assert "ffn_hidden_size=128" in out["incompatible"]
    assert ckpt.read_latest_iteration(root) == 4


@pytest.mark.parametrize("tp", [2, 4])
def test_rectangles_tile_the_global_tensors(tp):
    """Single process: the tp shards' rectangles rebuild every global tensor exactly, with
    vocabulary padding (100 rows padded to 128: tp rank 3 of 4 holds 4 real rows; the 28
    padding rows tile `<name>/vocab_padding`)."""
    from pentatron.models import shard_full_tensor
    from pentatron.pretrain.checkpointing.rectangles import ShardInfo, param_rects

    config = tiny_config()
    full = full_state(config, 0)
    full["embedding.word_embeddings.weight"] = full["embedding.word_embeddings.weight"][:100]
    rebuilt: dict[str, torch.Tensor] = {}
    for r in range(tp):
        info = ShardInfo(config, 0, r, tp, 100, 128, tied_output=True)
        for name, tensor in full.items():
            shard = shard_full_tensor(name, tensor, r, tp, config=config, padded_vocab_size=128)
            for rect in param_rects(name, tuple(shard.shape), info):
                if not rect.writer:  # a replica: tp rank 0 writes the same values
                    continue
                out = rebuilt.setdefault(rect.key, torch.full(rect.global_shape, float("nan")))
                part = shard[rect.local]
                where = tuple(slice(o, o + n) for o, n in zip(rect.offsets, part.shape))
                assert out[where].isnan().all(), (rect.key, r)  # no overlap
                out[where] = part
    for name, tensor in full.items():
        if name.endswith("linear_fc1.weight") or name.endswith("linear_fc1.bias"):
            got = torch.cat([rebuilt.pop(f"{name}/gate"), rebuilt.pop(f"{name}/up")])
        else:
            got = rebuilt.pop(name)
        assert torch.equal(got, tensor), name
    padding = rebuilt.pop("embedding.word_embeddings.weight/vocab_padding")
    assert torch.equal(padding, torch.zeros(28, config.hidden_size))  # shard_full_tensor's
    assert not rebuilt


def async_lifecycle(root, states):
    """World 4 at tp2-pp2 with --async-save: the write runs while training goes on; the
    checkpoint appears only at finalize and holds the state at save time (not later)."""
    grid = make_grid(2, 2, None)
    run = build_run(grid, states[0], dist_opt=True)
    saver = ckpt.AsyncSaver()
    train_step(run, 0)
    _save(run, root, 1, async_saver=saver)
    saved = _snapshot(run)
    out = {"latest_before_finalize": ckpt.read_latest_iteration(root)}
    for step in (1, 2):  # optimizer steps overwrite the params the thread is writing
        train_step(run, step)
    out["published"] = saver.finalize(blocking=True)
    out["latest_after"] = ckpt.read_latest_iteration(root)
    out["nothing_in_flight"] = saver.finalize(blocking=True) is None and not saver.pending()
    fresh = build_run(grid, states[1], dist_opt=True)
    out["loaded"] = _load(fresh, root)
    out["state_at_save"] = _equal(_snapshot(fresh), saved)
    _save(run, root, 3, async_saver=saver)
    _save(run, root, 4, async_saver=saver)  # waits for 3, publishes it, starts 4
    out["after_second"] = ckpt.read_latest_iteration(root)
    saver.finalize(blocking=True)
    out["entries"] = sorted(n for n in os.listdir(root) if n.startswith("iter_"))
    destroy_model_parallel(grid)
    return out


def test_async_save_writes_the_state_at_save_time(distributed, tmp_path):
    root = str(tmp_path / "run")
    states = [full_state(tiny_config(), seed) for seed in (0, 1)]
    for out in distributed.run(4, async_lifecycle, root, states):
        assert out["latest_before_finalize"] is None
        assert out["published"] == 1 and out["latest_after"] == 1
        assert out["nothing_in_flight"]
        assert out["loaded"] == ckpt.LoadedCheckpoint(1, 8, ARGS) and out["state_at_save"]
        assert out["after_second"] == 3
        assert out["entries"] == ["iter_0000001", "iter_0000003", "iter_0000004"]
