"""Global grad-norm clipping at tp2-pp2-dp2 vs the same model in one process.

The model (8 ranks; rank = tp + 2 dp + 4 pp):
- stage 0: tied embedding `E` (vocab-parallel) -> `* g0` (a layer-norm-style weight,
  replicated over tp) -> column-parallel linear (sharded bias) -> tanh -> row-parallel
  linear (replicated bias); loss0 = mean(out^2).
- stage 1: input `z` -> `* g1` -> column -> tanh -> row -> logits = out @ E^T through the
  tied output layer (a second copy of `E`, marked `shared`) -> loss1 = cross-entropy.
The loss is loss0 + loss1; the stages are independent except for the tied weight, so no
activations cross the pipeline (clipping only sees grads). The embedding-group all-reduce
sums the two copies' grads, as in Megatron. Columns 0-1 of `z` are zero, which makes exact
zeros in the grads of `g1` (replicated) and of the stage-1 column weight (sharded).

Checked: the grad norm equals the single-process norm of the distinct params (each counted
once), the zero count equals the single-process count, and the clipped grads (read off an
SGD step with lr 1) equal the single-process clipped grads. Tolerance 1e-5 (fp32; only the
summation order differs).
"""

import pytest
import torch

from pentatron.optim import (
    DDPConfig,
    DistributedDataParallel,
    OptimizerConfig,
    finalize_model_grads,
    get_optimizer,
)
from pentatron.parallel_state import ParallelConfig, initialize_model_parallel

V, H, F, B, TP, DP = 16, 8, 16, 8, 2, 2
CLIP = 0.05
TOL = 1e-5


def full_params():
    g = torch.Generator().manual_seed(42)
    out = {"E": torch.randn(V, H, generator=g)}
    for s in (0, 1):
        out[f"{s}.g"] = 1.0 + 0.1 * torch.randn(H, generator=g)
        out[f"{s}.col.weight"] = 0.3 * torch.randn(F, H, generator=g)
        out[f"{s}.col.bias"] = 0.1 * torch.randn(F, generator=g)
        out[f"{s}.row.weight"] = 0.3 * torch.randn(H, F, generator=g)
        out[f"{s}.row.bias"] = 0.1 * torch.randn(H, generator=g)
    return out


def data():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, V, (B,), generator=g)
    z = torch.randn(B, H, generator=g)
    z[:, :2] = 0.0
    labels = torch.randint(0, V, (B,), generator=g)
    return ids, z, labels


def reference():
    """Single process: grads of every distinct param, norm, zeros and clipped grads."""
    p = {k: v.clone().requires_grad_() for k, v in full_params().items()}
    ids, z, labels = data()

    def block(s, h):
        u = torch.tanh(h @ p[f"{s}.col.weight"].T + p[f"{s}.col.bias"])
        return u @ p[f"{s}.row.weight"].T + p[f"{s}.row.bias"]

    loss0 = block(0, p["E"][ids] * p["0.g"]).pow(2).mean()
    logits = block(1, z * p["1.g"]) @ p["E"].T
    loss1 = torch.nn.functional.cross_entropy(logits, labels)
    (loss0 + loss1).backward()
    grads = {k: v.grad for k, v in p.items()}
    norm = float(torch.sqrt(sum(g.pow(2).sum() for g in grads.values())))
    zeros = sum(int((g == 0).sum()) for g in grads.values())
    coeff = min(1.0, CLIP / (norm + 1e-6))
    return norm, zeros, {k: g * coeff for k, g in grads.items()}


class Stage(torch.nn.Module):
    def __init__(self, stage, tp_group):
        from pentatron.tp_layers import (
            ColumnParallelLinear,
            RowParallelLinear,
            VocabParallelEmbedding,
        )

        super().__init__()
        self.stage = stage
        self.g = torch.nn.Parameter(torch.empty(H))  # replicated over tp: counted on tp rank 0
        self.col = ColumnParallelLinear(H, F, tp_group=tp_group, bias=True)
        self.row = RowParallelLinear(F, H, tp_group=tp_group, bias=True, input_is_parallel=True)
        if stage == 0:
            self.embedding = VocabParallelEmbedding(V, H, tp_group=tp_group)
            self.embedding.weight.shared_embedding = True
        else:
            self.output_layer = ColumnParallelLinear(
                H,
                V,
                tp_group=tp_group,
                bias=False,
                skip_weight_param_allocation=True,
                gather_output=True,
            )
            self.output_weight = torch.nn.Parameter(torch.empty(V // TP, H))
            w = self.output_weight
            w.tensor_model_parallel, w.partition_dim = True, 0
            w.shared, w.shared_embedding = True, True  # Megatron: the second tied copy

    def forward(self, x):
        h = self.embedding(x[:, None])[:, 0] if self.stage == 0 else x
        u = torch.tanh(self.col(h * self.g)[0])
        out = self.row(u)[0]
        if self.stage == 0:
            return out.pow(2).mean()
        return self.output_layer(out, weight=self.output_weight)[0]

    def shards(self, tp_rank):
        """(param, key in full_params, slice of the full tensor) for every param."""
        f, v = (
            slice(tp_rank * F // TP, (tp_rank + 1) * F // TP),
            slice(tp_rank * V // TP, (tp_rank + 1) * V // TP),
        )
        s = self.stage
        emb = self.embedding.weight if s == 0 else self.output_weight
        return [
            ("E", emb, (v,)),
            (f"{s}.g", self.g, (slice(None),)),
            (f"{s}.col.weight", self.col.weight, (f,)),
            (f"{s}.col.bias", self.col.bias, (f,)),
            (f"{s}.row.weight", self.row.weight, (slice(None), f)),
            (f"{s}.row.bias", self.row.bias, (slice(None),)),
        ]


def clipped_step(dist_opt):
    grid = initialize_model_parallel(ParallelConfig(tp=TP, pp=2))
    tp, pp, dp = grid.rank("tp"), grid.rank("pp"), grid.rank("dp")
    stage = Stage(pp, grid.group("tp"))
    full = full_params()
    with torch.no_grad():
        for key, param, index in stage.shards(tp):
            param.copy_(full[key][index])
    ddp = DistributedDataParallel(
        DDPConfig(use_distributed_optimizer=dist_opt, overlap_grad_reduce=True, bucket_size=64),
        stage,
        grid=grid,
    )
    opt = get_optimizer(
        OptimizerConfig(
            optimizer="sgd",
            lr=1.0,
            sgd_momentum=0.0,
            weight_decay=0.0,
            clip_grad=CLIP,
            log_num_zeros_in_grad=True,
            use_distributed_optimizer=dist_opt,
        ),
        [ddp],
        grid=grid,
    )
    ids, z, labels = data()
    rows = slice(dp * B // DP, (dp + 1) * B // DP)
    if pp == 0:
        loss = ddp(ids[rows])
    else:
        loss = torch.nn.functional.cross_entropy(ddp(z[rows]), labels[rows])
    loss.backward()
    finalize_model_grads([ddp], grid=grid)
    before = {key: param.detach().clone() for key, param, _ in stage.shards(tp)}
    result = opt.step()
    ddp.finish_param_sync()
    deltas = {key: before[key] - param.detach() for key, param, _ in stage.shards(tp)}
    index = {key: idx for key, _, idx in stage.shards(tp)}
    return {
        "norm": result.grad_norm,
        "zeros": result.num_zeros_in_grad,
        "deltas": deltas,
        "index": index,
    }


@pytest.fixture(scope="module")
def ref():
    return reference()


@pytest.mark.parametrize("dist_opt", [False, True], ids=["mixed-precision", "distributed"])
def test_global_norm_and_clipping_match_one_process(distributed, ref, dist_opt):
    norm, zeros, clipped = ref
    assert norm > 2 * CLIP  # clipping is active, so the clipped grads test the norm too
    assert zeros >= 2 + 2 * F  # the zero columns of z: g1[:2] and the stage-1 col weight
    results = distributed.run(8, clipped_step, dist_opt)
    for rank, got in enumerate(results):
        assert got["norm"] == pytest.approx(norm, rel=TOL), rank
        assert got["zeros"] == zeros, rank
        for key, delta in got["deltas"].items():
            expected = clipped[key][got["index"][key]]
            torch.testing.assert_close(
                delta, expected, atol=TOL, rtol=TOL, msg=f"rank {rank} {key}"
            )


def test_counting_a_duplicate_twice_would_be_caught(ref):
    """The test above can fail: counting g0, g1 and the row biases on both tp ranks (or the
    tied copy twice) moves the norm far beyond the tolerance."""
    norm, _, clipped = ref
    coeff = min(1.0, CLIP / (norm + 1e-6))
    grads = {k: g / coeff for k, g in clipped.items()}
    dup = sum(float(grads[k].pow(2).sum()) for k in grads if k.endswith((".g", ".row.bias")))
    tied = float(grads["E"].pow(2).sum())
    assert ((norm**2 + dup) ** 0.5 - norm) / norm > 100 * TOL
    assert ((norm**2 + tied) ** 0.5 - norm) / norm > 100 * TOL
