"""Split backward (B now, W later) of the parallel linears, against the undivided backward.

A column -> row pair at tp2 (with and without sequence parallelism; with SP the column layer
keeps only its s/t input shard and gathers it again in W), two micro-batches, fp64:
- B alone gives the undivided input gradient and leaves every weight and bias gradient
  of the linears' matmul untouched (no `.grad`, `main_grad` zero, no post-accumulate hook fired);
- after the W's, the weight and bias gradients equal the undivided ones (rel 1e-12), with
  gradient-accumulation fusion into `main_grad` under a DDP-like hook, and without;
- each param's hook fires once per W, so a DDP bucket is ready only after its W ran.
"""

import pytest
import torch
import torch.distributed as dist

from pentatron.tp_layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    WeightGradStore,
    deferring_store,
    init_method_normal,
)

S, B, H, FFN = 8, 2, 6, 12
# The row layer adds its bias after the tp reduction, outside the linear: autograd's own
# op, whose gradient comes in B.
IN_B = "1.bias"
TOL = {"rtol": 1e-12, "atol": 1e-12}


def _pair(group, sp, fuse):
    torch.manual_seed(3)
    kw = {"tp_group": group, "sequence_parallel": sp, "gradient_accumulation_fusion": fuse}
    col = ColumnParallelLinear(
        H, FFN, init_method=init_method_normal(0.5), params_dtype=torch.float64, **kw
    )
    row = RowParallelLinear(
        FFN,
        H,
        input_is_parallel=True,
        init_method=init_method_normal(0.5),
        params_dtype=torch.float64,
        **kw,
    )
    with torch.no_grad():
        for p in (col.bias, row.bias):
            p.copy_(torch.linspace(-1, 1, p.numel(), dtype=torch.float64))
    return torch.nn.ModuleList([col, row])


def _ddp_like(model, fires):
    """main_grad buffers and a hook that adds `.grad` into them (as DDP's does). Autograd
    also runs the hook in B, with no gradient, for a weight whose W was deferred: such a
    call delivers nothing and is not counted (DDP does not mark the param ready on it)."""
    for name, p in model.named_parameters():
        p.main_grad = torch.zeros_like(p)
        p.grad_added_to_main_grad = False

        def hook(param, name=name):
            if param.grad is None and not param.grad_added_to_main_grad:
                return
            if param.grad is not None and not param.grad_added_to_main_grad:
                param.main_grad.add_(param.grad)
            param.grad, param.grad_added_to_main_grad = None, False
            fires[name] = fires.get(name, 0) + 1

        p.register_post_accumulate_grad_hook(hook)


def _micro_batches(sp, tp, rank):
    out = []
    for k in range(2):
        g = torch.Generator().manual_seed(10 + k)
        x = torch.randn(S, B, H, generator=g, dtype=torch.float64)
        dy = torch.randn(S, B, H, generator=g, dtype=torch.float64)
        if sp:  # the sequence shard of this rank
            x, dy = x.chunk(tp)[rank], dy.chunk(tp)[rank]
        out.append((x.requires_grad_(), dy))
    return out


def _run(model, batches, store=None):
    """Backward of each micro-batch (deferred into `store` if given); the input grads."""
    col, row = model
    grads = []
    for x, dy in batches:
        y, _ = row(col(x)[0])
        if store is None:
            y.backward(dy)
        else:
            with store.defer():
                assert deferring_store() is store
                y.backward(dy)
            store.close_group()
        grads.append(x.grad.clone())
    return grads


def _grads(model, fused):
    return {n: (p.main_grad if fused else p.grad).clone() for n, p in model.named_parameters()}


def _case(sp, fuse):
    group = dist.group.WORLD
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    ref, split = _pair(group, sp, fuse), _pair(group, sp, fuse)
    ref_fires, split_fires = {}, {}
    if fuse:
        _ddp_like(ref, ref_fires)
        _ddp_like(split, split_fires)
    batches = _micro_batches(sp, tp, rank)
    want_in = _run(ref, [(x.detach().clone().requires_grad_(), dy) for x, dy in batches])
    want = _grads(ref, fuse)

    store = WeightGradStore()
    got_in = _run(split, batches, store)
    for got, w in zip(got_in, want_in):
        torch.testing.assert_close(got, w, **TOL)
    # B only: no weight or bias gradient anywhere yet, no hook fired.
    assert len(store) == 2 and deferring_store() is None
    x = batches[0][0]
    saved = (x.numel() if sp else S * B * H) + S * B * FFN // tp  # column: input (shard), dY
    saved += S * B * FFN // tp + S * B * H  # row: its input, dY (before the reduction)
    assert store.pending_bytes() == 2 * 8 * saved
    for name, p in split.named_parameters():
        if name == IN_B:
            continue
        assert p.grad is None, name
        if fuse:
            assert not p.main_grad.any(), name
    assert split_fires == ({IN_B: 2} if fuse else {}), split_fires
    store.run_oldest()
    if fuse:
        assert split_fires == {**dict.fromkeys(ref_fires, 1), IN_B: 2}
    store.run_oldest()
    assert len(store) == 0 and store.pending_bytes() == 0
    got = _grads(split, fuse)
    for name in want:
        torch.testing.assert_close(got[name], want[name], **TOL, msg=lambda m, n=name: f"{n}: {m}")
    assert split_fires == ref_fires  # one hook per param per micro-batch, as undivided
    with pytest.raises(RuntimeError, match="no sealed group"):
        store.run_oldest()
    return True


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
@pytest.mark.parametrize("fuse", [False, True], ids=["grad", "fused-main-grad"])
def test_split_backward_matches_undivided(distributed, sp, fuse):
    assert distributed.run(2, _case, sp, fuse) == [True, True]


# --- the embedding and the norms ---------------------------------------------------------


def _embed_and_norm(group, zero_centered):
    """Vocabulary-parallel embedding (tp2: each rank owns half the rows) -> RMSNorm ->
    LayerNorm (weight and bias), fp64."""
    from pentatron.tp_layers import VocabParallelEmbedding

    torch.manual_seed(5)
    emb = VocabParallelEmbedding(
        16, H, tp_group=group, init_method=init_method_normal(1.0), params_dtype=torch.float64
    )
    ln = torch.nn.ParameterDict(
        {
            "rms": torch.nn.Parameter(torch.linspace(0.5, 1.5, H, dtype=torch.float64)),
            "ln_w": torch.nn.Parameter(torch.linspace(-0.3, 0.7, H, dtype=torch.float64)),
            "ln_b": torch.nn.Parameter(torch.linspace(0.2, -0.2, H, dtype=torch.float64)),
        }
    )
    return torch.nn.ModuleDict({"emb": emb, "ln": ln}), zero_centered


def _forward(model, ids):
    from pentatron.tp_layers import layer_norm, rms_norm

    model, zc = model
    p = model["ln"]
    h = rms_norm(model["emb"](ids), p["rms"], 1e-6, zc)
    return layer_norm(h, p["ln_w"], p["ln_b"], 1e-5, zc)


def _embedding_norm_case(zero_centered):
    group = dist.group.WORLD
    ref, split = _embed_and_norm(group, zero_centered), _embed_and_norm(group, zero_centered)
    batches = []
    for k in range(2):
        g = torch.Generator().manual_seed(20 + k)
        batches.append((torch.randint(0, 16, (B, S), generator=g),
                        torch.randn(B, S, H, generator=g, dtype=torch.float64)))  # fmt: skip
    for ids, dy in batches:
        _forward(ref, ids).backward(dy)
    store = WeightGradStore()
    for ids, dy in batches:
        with store.defer():
            _forward(split, ids).backward(dy)
        store.close_group()
    # B only: no gradient on the table or the norms' weights; W holds ids, x's and dY's.
    assert all(p.grad is None for p in split[0].parameters())
    assert store.pending_bytes() > 0
    store.run_all()
    for (name, want), got in zip(ref[0].named_parameters(), split[0].parameters()):
        assert want.grad is not None and got.grad is not None, name
        assert torch.equal(got.grad, want.grad), name  # bitwise
    return True


@pytest.mark.parametrize("zero_centered", [False, True], ids=["gamma", "zero-centered-gamma"])
def test_embedding_and_norm_weight_grads_defer_bitwise(distributed, zero_centered):
    assert distributed.run(2, _embedding_norm_case, zero_centered) == [True, True]
