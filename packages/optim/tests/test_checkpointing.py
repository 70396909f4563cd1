"""Sharded optimizer checkpoints (DCP): save at dp=4, reload at dp=2 or without sharding.

The reference is the run that continues at dp=4 after the save. Reloading at the same dp
size reproduces it bit for bit; at dp=2 (or with the non-distributed optimizer) the grad
reduction sums in another order, so params agree to 1e-6 absolute / 1e-5 relative (fp32),
while skipping the optimizer state moves them by more than 1e-3 (the check is not vacuous).
Param sizes (7x13, 13, 13, 5x13, 5) are not multiples of dp and the buckets are small, so
rank pieces start mid-param and padding lies between them.
"""

import os

import pytest
import torch

from pentatron.optim import (
    DDPConfig,
    DistributedDataParallel,
    OptimizerConfig,
    finalize_model_grads,
    get_optimizer,
)
from pentatron.optim.checkpointing import (
    CheckpointMismatchError,
    load_optimizer,
    save_optimizer,
    sharded_state_dict,
)
from pentatron.parallel_state import ParallelConfig, initialize_model_parallel

BATCH, LR, WD, CLIP = 8, 1e-2, 0.1, 1.0
ATOL, RTOL = 1e-6, 1e-5


def make_model(seed, variant="base"):
    torch.manual_seed(seed)
    last_out = 6 if variant == "wide" else 5
    layers = [
        torch.nn.Linear(7, 13),
        torch.nn.LayerNorm(13),
        torch.nn.Tanh(),
        torch.nn.Linear(13, last_out, bias=variant != "no_bias"),
    ]
    if variant == "extra":
        layers.append(torch.nn.Linear(5, 5))
    model = torch.nn.Sequential(*layers)
    if variant == "transposed":  # same numel, another shape
        model[3].weight = torch.nn.Parameter(torch.zeros(13, 5))
    return model


def build(grid, seed, dist_opt=True, variant="base", dtype=torch.float32):
    ddp_cfg = DDPConfig(
        use_distributed_optimizer=dist_opt, bucket_size=60, grad_reduce_in_fp32=True
    )
    model = DistributedDataParallel(ddp_cfg, make_model(seed, variant).to(dtype), grid=grid)
    opt_cfg = OptimizerConfig(
        lr=LR,
        weight_decay=WD,
        clip_grad=CLIP,
        bf16=dtype == torch.bfloat16,
        use_distributed_optimizer=dist_opt,
    )
    return model, get_optimizer(opt_cfg, [model], grid=grid)


def step(model, opt, grid, i):
    g = torch.Generator().manual_seed(10 + i)
    x, y = torch.randn(BATCH, 7, generator=g), torch.randn(BATCH, 5, generator=g)
    d, r = grid.size("dp"), grid.rank("dp")
    dtype = next(model.parameters()).dtype
    out = model(x.chunk(d)[r].to(dtype)).float()
    torch.nn.functional.mse_loss(out, y.chunk(d)[r]).backward()
    finalize_model_grads([model], grid=grid)
    assert opt.step().update_successful
    opt.zero_grad()
    model.finish_param_sync()


def main_pieces(opt):
    """This rank's fp32 main-param pieces: {key: (numel, [(offset, copy)])}."""
    sd = sharded_state_dict(opt)
    return {
        k: (v.numel, [(o, t.clone()) for o, t in v.pieces])
        for k, v in sd.items()
        if k.endswith("/main")
    }


def assemble(per_rank):
    """Full flat main params from every rank's pieces (NaN where nobody wrote)."""
    full = {}
    for pieces in per_rank:
        for k, (numel, items) in pieces.items():
            t = full.setdefault(k, torch.full((numel,), float("nan")))
            for o, piece in items:
                t[o : o + piece.numel()] = piece
    return full


def bf16_run(grid, root, save):
    """bf16 params with fp32 main params: the main params survive the reshard exactly."""
    model, opt = build(grid, seed=0 if save else 5, dtype=torch.bfloat16)
    if save:
        for i in range(2):
            step(model, opt, grid, i)
        save_optimizer(opt, os.path.join(root, "bf16"))
    else:
        load_optimizer(opt, os.path.join(root, "bf16"))
    return {"mains": main_pieces(opt), "params": params(model)}


def params(model):
    return [p.detach().clone() for p in model.module.parameters()]


def save_at_dp4(root):
    """Train 2 steps at dp=4, save, step a 3rd time; reload at dp=4 into a fresh model."""
    grid = initialize_model_parallel(ParallelConfig())
    model, opt = build(grid, seed=0)
    for i in range(2):
        step(model, opt, grid, i)
    before = params(model)
    path = os.path.join(root, "dp4")
    save_optimizer(opt, path)
    leftovers = sorted(os.listdir(root))
    with pytest.raises(FileExistsError):
        save_optimizer(opt, path)
    step(model, opt, grid, 2)
    ref = params(model)

    fresh, fresh_opt = build(grid, seed=1)
    load_optimizer(fresh_opt, path)
    loaded = params(fresh)
    step(fresh, fresh_opt, grid, 2)
    out_bf16 = bf16_run(grid, root, save=True)
    # Nothing in a checkpoint goes through DCP's pickled-bytes path.
    kinds = sorted({type(v).__name__ for v in sharded_state_dict(opt).values()})
    return {
        "before": before,
        "ref": ref,
        "loaded": loaded,
        "same_dp": params(fresh),
        "leftovers": leftovers,
        "kinds": kinds,
        "bf16": out_bf16,
    }


def load_at_dp2(root, before):
    """Reload the dp=4 checkpoint at dp=2 (distributed and plain optimizer), step once."""
    grid = initialize_model_parallel(ParallelConfig())
    out = {}
    model, opt = build(grid, seed=1)
    load_optimizer(opt, os.path.join(root, "dp4"))
    out["loaded"] = params(model)
    step(model, opt, grid, 2)
    out["dist"] = params(model)

    # Non-distributed optimizer: load the sharded checkpoint, save it again unsharded, step.
    plain, plain_opt = build(grid, seed=2, dist_opt=False)
    load_optimizer(plain_opt, os.path.join(root, "dp4"))
    save_optimizer(plain_opt, os.path.join(root, "plain"))
    step(plain, plain_opt, grid, 2)
    out["plain"] = params(plain)
    # ... and the unsharded checkpoint back into the distributed optimizer.
    model, opt = build(grid, seed=3)
    load_optimizer(opt, os.path.join(root, "plain"))
    step(model, opt, grid, 2)
    out["plain_to_dist"] = params(model)

    # Control: the same params without the optimizer state give another step.
    model, opt = build(grid, seed=1)
    with torch.no_grad():
        for p, b in zip(model.module.parameters(), before):
            p.copy_(b)
    step(model, opt, grid, 2)
    out["no_state"] = params(model)

    errors = {}
    for variant in ["wide", "extra", "no_bias", "transposed"]:
        _, bad_opt = build(grid, seed=1, variant=variant)
        try:
            load_optimizer(bad_opt, os.path.join(root, "dp4"))
        except CheckpointMismatchError as e:
            errors[variant] = str(e)
    _, bad_opt = build(grid, seed=1, variant="no_bias")
    load_optimizer(bad_opt, os.path.join(root, "dp4"), strict=False)  # extra state is skipped
    out["bf16"] = bf16_run(grid, root, save=False)
    return out, errors


def close(a, b):
    return all(torch.allclose(x, y, atol=ATOL, rtol=RTOL) for x, y in zip(a, b))


def test_reshard_dp4_to_dp2(distributed, tmp_path):
    root = str(tmp_path)
    saved = distributed.run(4, save_at_dp4, root)
    ref, before = saved[0]["ref"], saved[0]["before"]
    assert saved[0]["leftovers"] == ["dp4"]  # the temporary directory was renamed
    assert saved[0]["kinds"] == ["FlatPieces", "Tensor"]
    for rank in saved:
        assert all(torch.equal(a, b) for a, b in zip(rank["loaded"], before))
        assert all(torch.equal(a, b) for a, b in zip(rank["same_dp"], ref))

    results = distributed.run(2, load_at_dp2, root, before)
    for out, errors in results:
        assert all(torch.equal(a, b) for a, b in zip(out["loaded"], before))
        for key in ["dist", "plain", "plain_to_dist"]:
            for a, b in zip(out[key], ref):
                torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL, msg=key)
        diff = max((a - b).abs().max().item() for a, b in zip(out["no_state"], ref))
        assert diff > 1e-3, diff
        assert "4.weight" in errors["extra"] and "no optimizer state" in errors["extra"]
        assert "3.bias" in errors["no_bias"] and "strict=False" in errors["no_bias"]
        assert "param 3." in errors["wide"] and "the model 6" in errors["wide"]
        assert "(13, 5)" in errors["transposed"] and "(5, 13)" in errors["transposed"]
        for a, b in zip(out["bf16"]["params"], saved[0]["bf16"]["params"]):
            assert a.dtype == torch.bfloat16 and torch.equal(a, b)

    saved_mains = assemble(r["bf16"]["mains"] for r in saved)
    loaded_mains = assemble(r[0]["bf16"]["mains"] for r in results)
    assert saved_mains.keys() == loaded_mains.keys() and len(saved_mains) == 6
    for k, full in saved_mains.items():
        assert not full.isnan().any() and torch.equal(full, loaded_mains[k]), k
    # the fp32 main params are more than their bf16 rounding (so they were loaded, not derived)
    assert any(not torch.equal(m, m.bfloat16().float()) for m in saved_mains.values())
