"""TopKRouter, load-balancing losses, capacity dropping, aux-loss tracking and the expert
bias, each against an independent closed form / brute force written here (fp64, rtol 1e-9
unless stated). Two gloo ranks check the tp-cp shares (sum = one process on all tokens),
the tracker's reductions and the expert-bias rule across ranks with different loads."""

from __future__ import annotations

import itertools

import pytest
import torch

from pentatron.models import ModelConfigError, TransformerConfig
from pentatron.models.moe.aux_tracker import collect_moe_aux_losses, reset_moe_aux_losses
from pentatron.models.moe.capacity import drop_tokens, get_capacity
from pentatron.models.moe.expert_bias import reset_expert_bias_counts, update_expert_bias
from pentatron.models.moe.load_balancing import set_aux_loss_scale
from pentatron.models.moe.router import TopKRouter
from pentatron.parallel_state import (
    ParallelConfig,
    destroy_model_parallel,
    initialize_model_parallel,
)

H, E, S, B = 8, 8, 6, 2
RTOL = 1e-9


def cfg(**kw) -> TransformerConfig:
    base = dict(
        num_layers=2,
        hidden_size=H,
        num_attention_heads=2,
        num_moe_experts=E,
        moe_router_topk=2,
        params_dtype=torch.float64,
        init_method_std=0.5,
        add_bias_linear=False,  # the closed forms below have no logit bias; tested apart
    )
    base.update(kw)
    return TransformerConfig(**base)


def make_router(seed: int = 0, layer_number: int = 1, group=None, **kw) -> TopKRouter:
    torch.manual_seed(seed)
    return TopKRouter(cfg(**kw), layer_number=layer_number, tp_cp_group=group)


def hidden(seed: int = 1, s: int = S, b: int = B) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(s, b, H, generator=g, dtype=torch.float64)


def aux_grad(router: TopKRouter, x: torch.Tensor) -> torch.Tensor:
    """Grad of the attached losses alone: the probs' own path gets a zero grad."""
    router.weight.grad = None
    probs, _ = router(x)
    (probs * 0).sum().backward()
    return router.weight.grad.clone()


# --- closed forms written from the formulas ----------------------------------------------
def scores_of(logits: torch.Tensor, fn: str) -> torch.Tensor:
    if fn == "softmax":
        return torch.softmax(logits, -1)
    s = torch.sigmoid(logits)
    return s / s.sum(-1, keepdim=True)


def topk_map(scores: torch.Tensor, k: int) -> torch.Tensor:
    m = torch.zeros_like(scores, dtype=torch.bool)
    for t in range(scores.shape[0]):
        for e in sorted(range(scores.shape[1]), key=lambda e: -float(scores[t, e]))[:k]:
            m[t, e] = True
    return m


def switch_closed(w, x, coeff, k, fn="softmax"):
    sc = scores_of(x.reshape(-1, H) @ w.T, fn)
    f = topk_map(sc.detach(), k).double().sum(0) / (sc.shape[0] * k)
    p = sc.mean(0)
    return coeff * E * (f * p).sum()


def seq_closed(w, x, coeff, k):
    s, b = x.shape[:2]
    sc = scores_of(x.reshape(-1, H) @ w.T, "softmax").view(s, b, E)
    total = 0.0
    for j in range(b):
        f = topk_map(sc[:, j].detach(), k).double().sum(0) / (s * k)
        total = total + E * (f * sc[:, j].mean(0)).sum()
    return coeff * total / b


def z_closed(w, x, coeff):
    return coeff * (torch.logsumexp(x.reshape(-1, H) @ w.T, -1) ** 2).mean()


CLOSED = {
    "aux_loss": lambda w, x: switch_closed(w, x, 0.1, 2),
    "aux_loss_sigmoid": lambda w, x: switch_closed(w, x, 0.1, 2, "sigmoid"),
    "seq_aux_loss": lambda w, x: seq_closed(w, x, 0.1, 2),
    "z_loss": lambda w, x: z_closed(w, x, 0.01),
}
ROUTER_KW = {
    "aux_loss": dict(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.1),
    "aux_loss_sigmoid": dict(
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=0.1,
        moe_router_score_function="sigmoid",
    ),
    "seq_aux_loss": dict(moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=0.1),
    "z_loss": dict(moe_router_load_balancing_type="none", moe_z_loss_coeff=0.01),
}
RECORD = {"aux_loss": "load_balancing_loss", "aux_loss_sigmoid": "load_balancing_loss"}
RECORD |= {"seq_aux_loss": "seq_load_balancing_loss", "z_loss": "z_loss"}
COEFF = {"aux_loss": 0.1, "aux_loss_sigmoid": 0.1, "seq_aux_loss": 0.1, "z_loss": 0.01}


def closed_value_and_grad(kind: str, w: torch.Tensor, x: torch.Tensor):
    w = w.detach().clone().requires_grad_(True)
    loss = CLOSED[kind](w, x)
    loss.backward()
    return loss.detach(), w.grad


@pytest.mark.parametrize("kind", list(CLOSED))
def test_loss_value_and_grad_match_closed_form(kind: str) -> None:
    router, x = make_router(**ROUTER_KW[kind]), hidden()
    grad = aux_grad(router, x)
    value = router.aux_loss_record.mean(RECORD[kind]) * COEFF[kind]
    ref_value, ref_grad = closed_value_and_grad(kind, router.weight, x)
    torch.testing.assert_close(value, ref_value, rtol=RTOL, atol=0)
    torch.testing.assert_close(grad, ref_grad, rtol=RTOL, atol=1e-14)
    assert ref_grad.abs().sum() > 0


def test_aux_loss_scale_multiplies_the_grad() -> None:
    router, x = make_router(**ROUTER_KW["aux_loss"]), hidden()
    base = aux_grad(router, x)
    set_aux_loss_scale(torch.tensor([0.25]))
    try:
        torch.testing.assert_close(aux_grad(router, x), base * 0.25, rtol=RTOL, atol=0)
    finally:
        set_aux_loss_scale(1.0)


def test_no_loss_in_eval_or_no_grad() -> None:
    router, x = make_router(**ROUTER_KW["aux_loss"], moe_z_loss_coeff=0.1), hidden()
    router.eval()
    probs, _ = router(x)
    (probs * 0).sum().backward()
    assert not router.weight.grad.any()
    router.train()
    with torch.no_grad():
        router(x)
    assert router.aux_loss_record.mean("load_balancing_loss") is None


# --- routing -------------------------------------------------------------------------------
def ref_routing(logits: torch.Tensor, c: TransformerConfig, bias=None):
    """Per token: the route and probs from the definitions."""
    k, probs = c.moe_router_topk, torch.zeros_like(logits)
    for t in range(logits.shape[0]):
        z = logits[t]
        if c.moe_router_score_function == "softmax":
            sc = torch.softmax(z, -1) if c.moe_router_pre_softmax else z
        else:
            sc = torch.sigmoid(z)
        choice = sc + (bias if bias is not None else 0)
        top = sorted(range(E), key=lambda e: -float(choice[e]))[:k]
        vals = sc[top]
        if c.moe_router_score_function == "softmax" and not c.moe_router_pre_softmax:
            vals = torch.softmax(vals, -1)
        if c.moe_router_score_function == "sigmoid" and k > 1:
            vals = vals / vals.sum()
        probs[t, top] = vals * (c.moe_router_topk_scaling_factor or 1.0)
    return probs, probs != 0


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(moe_router_pre_softmax=True, moe_router_topk_scaling_factor=2.5),
        dict(moe_router_score_function="sigmoid"),
        dict(moe_router_score_function="sigmoid", moe_router_topk=1),
        dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True),
    ],
)
def test_routing_matches_definition(kw) -> None:
    router, x = make_router(moe_router_load_balancing_type="none", **kw), hidden()
    bias = None
    if router.expert_bias is not None:
        router.expert_bias.copy_(torch.linspace(-0.3, 0.3, E))
        bias = router.expert_bias.double()
    probs, rmap = router(x)
    logits = x.reshape(-1, H) @ router.weight.detach().T
    ref_p, ref_m = ref_routing(logits, router.config, bias)
    assert torch.equal(rmap, ref_m)
    torch.testing.assert_close(probs.detach(), ref_p, rtol=RTOL, atol=0)
    assert probs.shape == (S * B, E) and rmap.dtype == torch.bool


def test_group_limited_routing_stays_in_the_top_groups() -> None:
    groups, gk, k = 4, 2, 4
    router = make_router(
        moe_router_load_balancing_type="none",
        moe_router_topk=k,
        moe_router_num_groups=groups,
        moe_router_group_topk=gk,
        moe_router_pre_softmax=True,
    )
    x = hidden(s=16)
    _, rmap = router(x)
    sc = torch.softmax(x.reshape(-1, H) @ router.weight.detach().T, -1)
    size = E // groups
    for t in range(sc.shape[0]):
        gscore = [
            sorted(sc[t, g * size : (g + 1) * size].tolist())[-(k // gk) :] for g in range(groups)
        ]
        best = set(sorted(range(groups), key=lambda g: -sum(gscore[g]))[:gk])
        allowed = [e for e in range(E) if e // size in best]
        expect = set(sorted(allowed, key=lambda e: -float(sc[t, e]))[:k])
        assert set(rmap[t].nonzero().flatten().tolist()) == expect
    # and group limiting changed something somewhere (else the test would prove nothing)
    plain = topk_map(sc, k)
    assert not torch.equal(plain, rmap)


def sinkhorn_converged(logits: torch.Tensor) -> torch.Tensor:
    m = torch.exp(logits)
    for _ in range(5000):
        m = m / m.sum(1, keepdim=True) / m.shape[0]
        m = m / m.sum(0, keepdim=True) / m.shape[1]
    return m


def test_sinkhorn_routes_by_balanced_scores_without_aux_loss() -> None:
    router = make_router(moe_router_load_balancing_type="sinkhorn", moe_router_topk=2)
    x = hidden()
    probs, rmap = router(x)
    logits = x.reshape(-1, H) @ router.weight.detach().T
    assert torch.equal(rmap, topk_map(sinkhorn_converged(logits), 2))
    torch.testing.assert_close(probs.detach(), torch.softmax(logits, -1) * rmap, rtol=RTOL, atol=0)
    (probs * 0).sum().backward()
    assert not router.weight.grad.any()  # no aux loss attached
    router.eval()
    _, rmap_eval = router(x)
    assert torch.equal(rmap_eval, topk_map(torch.softmax(logits, -1), 2))


def test_input_jitter_only_in_training() -> None:
    router, x = (
        make_router(moe_router_load_balancing_type="none", moe_input_jitter_eps=0.5),
        hidden(),
    )
    router.eval()
    a, b = router(x)[0], router(x)[0]
    assert torch.equal(a, b)
    router.train()
    assert not torch.equal(router(x)[0], a)


# --- capacity ------------------------------------------------------------------------------
def brute_force_drop(probs, rmap, capacity, policy):
    keep = torch.zeros_like(rmap)
    for e in range(rmap.shape[1]):
        routed = [t for t in range(rmap.shape[0]) if rmap[t, e]]
        if policy == "probs":
            routed.sort(key=lambda t: (-float(probs[t, e]), t))
        for t in routed[:capacity]:
            keep[t, e] = True
    return probs * keep, keep


@pytest.mark.parametrize(
    "policy, factor", list(itertools.product(["probs", "position"], [0.5, 1.0, 1.5]))
)
def test_capacity_drops_what_the_policy_says(policy: str, factor: float) -> None:
    router = make_router(
        moe_router_load_balancing_type="none", moe_router_topk=2, init_method_std=2.0
    )
    x = hidden(s=12)
    with torch.no_grad():
        probs, rmap = router(x)
    capacity = get_capacity(probs.shape[0], E, 2, factor)
    assert capacity == -(-(probs.shape[0] * 2 * factor) // E)  # ceil(T k / E * cf)
    got_p, got_m = drop_tokens(probs, rmap, 2, factor, policy)
    ref_p, ref_m = brute_force_drop(probs, rmap, capacity, policy)
    assert torch.equal(got_m, ref_m)
    torch.testing.assert_close(got_p, ref_p, rtol=0, atol=0)
    assert got_m.sum(0).max() <= capacity
    if factor == 0.5:
        assert got_m.sum() < rmap.sum()  # something was dropped


def test_capacity_in_router_and_padding() -> None:
    router = make_router(
        moe_router_load_balancing_type="none",
        moe_expert_capacity_factor=0.5,
        moe_token_drop_policy="position",
        moe_pad_expert_input_to_capacity=True,
    )
    with torch.no_grad():
        probs, rmap = router(hidden())
    capacity = get_capacity(S * B, E, 2, 0.5)
    assert (rmap.sum(0) == capacity).all()  # padded to exactly capacity
    assert (probs[~rmap] == 0).all()


# --- bad input and bad settings -------------------------------------------------------------
def test_bad_hidden_size_is_a_clear_error() -> None:
    router = make_router()
    with pytest.raises(ValueError, match="hidden_size=8"):
        router(torch.randn(4, 2, H + 1, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"\[s_local, b, hidden_size"):
        router(torch.randn(8, H, dtype=torch.float64))


def test_bad_router_settings() -> None:
    with pytest.raises(ModelConfigError, match="moe_router_enable_expert_bias"):
        make_router(moe_router_enable_expert_bias=True)  # softmax
    with pytest.raises(ModelConfigError, match="moe_router_group_topk"):
        make_router(moe_router_topk=1, moe_router_num_groups=4, moe_router_group_topk=2)


def test_weight_init_and_attributes() -> None:
    router = make_router(sequence_parallel=True)
    assert router.weight.shape == (E, H) and router.weight.dtype == torch.float64
    assert router.weight.sequence_parallel is True
    torch.manual_seed(0)
    ref = torch.empty(E, H, dtype=torch.float64).normal_(0.0, 0.5)
    assert torch.equal(router.weight.detach(), ref)
    bias_router = make_router(
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True
    )
    assert "expert_bias" in bias_router.state_dict()
    assert "local_tokens_per_expert" not in bias_router.state_dict()


@pytest.mark.parametrize("router_dtype", [None, "fp32"])
def test_logit_bias_with_add_bias_linear(router_dtype) -> None:
    """Megatron's router under add_bias_linear: logits x W^T + b in the router dtype, b [E]
    drawn after W from N(0, std^2) and tagged like W; grads are plain autograd's of
    F.linear, returned in the parameters' dtype."""
    router = make_router(add_bias_linear=True, moe_router_dtype=router_dtype)
    torch.manual_seed(0)
    w_ref = torch.empty(E, H, dtype=torch.float64).normal_(0.0, 0.5)
    b_ref = torch.empty(E, dtype=torch.float64).normal_(0.0, 0.5)
    assert torch.equal(router.weight.detach(), w_ref) and torch.equal(router.bias.detach(), b_ref)
    assert router.bias.sequence_parallel is False and "bias" in router.state_dict()
    x = hidden().reshape(-1, H).requires_grad_()
    logits = router._gating(x)
    grad = torch.randn_like(logits)
    logits.backward(grad)
    w, b = w_ref.clone().requires_grad_(), b_ref.clone().requires_grad_()
    x2 = x.detach().clone().requires_grad_()
    dtype = torch.float32 if router_dtype == "fp32" else torch.float64
    ref = torch.nn.functional.linear(x2.to(dtype), w.to(dtype), b.to(dtype))
    ref.backward(grad)
    tol = {"rtol": RTOL, "atol": 1e-15} if dtype == torch.float64 else {"rtol": 1e-6, "atol": 1e-6}
    torch.testing.assert_close(logits, ref, **tol)
    for got, want in ((x.grad, x2.grad), (router.weight.grad, w.grad), (router.bias.grad, b.grad)):
        assert got.dtype == torch.float64  # the parameters' and input's dtype
        torch.testing.assert_close(got, want, **tol)
    assert make_router(add_bias_linear=False).bias is None


# --- tracker and expert bias in one process -----------------------------------------------
def test_tracker_averages_micro_batches_per_layer() -> None:
    kw = dict(ROUTER_KW["aux_loss"], moe_z_loss_coeff=0.01)
    routers = torch.nn.ModuleList([make_router(layer_number=2, **kw)])
    xs = [hidden(seed=s) for s in (1, 2, 3)]
    for x in xs:
        routers[0](x)
    out = collect_moe_aux_losses(routers)
    w = routers[0].weight.detach()
    lb = sum(switch_closed(w, x, 1.0, 2) for x in xs) / 3
    z = sum(z_closed(w, x, 1.0) for x in xs) / 3
    assert set(out) == {"load_balancing_loss", "z_loss"} and out["z_loss"].shape == (2,)
    torch.testing.assert_close(
        out["load_balancing_loss"], torch.stack([torch.zeros(()), lb]).double()
    )
    torch.testing.assert_close(out["z_loss"][1], z, rtol=RTOL, atol=0)
    reset_moe_aux_losses(routers)
    assert collect_moe_aux_losses(routers) == {}


def test_expert_bias_counts_and_update_one_process() -> None:
    router = make_router(
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_bias_update_rate=0.01,
    )
    _, rmap = router(hidden())
    counts = rmap.sum(0).double()
    torch.testing.assert_close(router.local_tokens_per_expert.double(), counts)
    with torch.no_grad():
        router(hidden())  # no_grad passes do not count
    assert update_expert_bias([router]) == 1
    expect = 0.01 * torch.sign(counts.mean() - counts)
    torch.testing.assert_close(router.expert_bias.double(), expect.float().double())
    assert not router.local_tokens_per_expert.any()


@pytest.mark.parametrize("pad", [False, True])
def test_expert_bias_counts_kept_assignments_not_padding(pad: bool) -> None:
    """Counts = the routed assignments kept after capacity dropping (Megatron's post-drop
    routing map), never padding slots: with padding every expert would count exactly
    capacity and the bias could not move."""
    router = make_router(
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_load_balancing_type="none",
        moe_expert_capacity_factor=0.5,
        moe_pad_expert_input_to_capacity=pad,
        init_method_std=2.0,
    )
    router.expert_bias.copy_(torch.linspace(-0.3, 0.3, E))
    bias, x = router.expert_bias.double(), hidden(s=12)
    _, rmap = router(x)
    logits = x.reshape(-1, H) @ router.weight.detach().T
    ref_p, ref_m = ref_routing(logits, router.config, bias)
    capacity = -(-(x.shape[0] * x.shape[1] * 2) // (2 * E))  # ceil(T k / E * 0.5)
    _, kept = brute_force_drop(ref_p, ref_m, capacity, "probs")
    want = kept.sum(0).double()
    assert (want < ref_m.sum(0)).any()  # tokens were dropped
    if pad:
        assert (rmap.sum(0) == capacity).all() and (want != capacity).any()
    torch.testing.assert_close(router.local_tokens_per_expert.double(), want, rtol=0, atol=0)
    update_expert_bias([router])
    step = (router.expert_bias.double() - bias) / 1e-3
    torch.testing.assert_close(step, torch.sign(want.mean() - want), rtol=0, atol=1e-3)
    assert step.abs().sum() > 0


def test_skipped_step_counts_do_not_leak() -> None:
    """A skipped step resets the counts; the next update sees only its own step."""
    router = make_router(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)
    router(hidden(seed=1))  # the skipped step
    assert reset_expert_bias_counts([router]) == 1
    assert not router.local_tokens_per_expert.any() and not router.expert_bias.any()
    _, rmap = router(hidden(seed=2))
    counts = rmap.sum(0).double()
    update_expert_bias([router])
    expect = (1e-3 * torch.sign(counts.mean() - counts)).float()
    assert torch.equal(router.expert_bias, expect)
    assert reset_expert_bias_counts(torch.nn.Linear(2, 2)) == 0  # no bias routers


# --- two ranks -------------------------------------------------------------------------------
def _two_rank_checks(x_full: torch.Tensor, kinds: list[str]) -> dict:
    """tp=2 (tp-cp group of 2, halves of the sequence), then dp=2 (tracker average, bias)."""
    out: dict = {"shares": {}, "grads": {}}
    grid = initialize_model_parallel(ParallelConfig(tp=2))
    try:
        r, half = grid.rank("tp"), x_full.shape[0] // 2
        x = x_full[r * half : (r + 1) * half]
        for kind in kinds:
            router = make_router(group=grid.group("tp-cp"), **ROUTER_KW[kind])
            out["grads"][kind] = aux_grad(router, x)
            out["shares"][kind] = router.aux_loss_record.mean(RECORD[kind]) * COEFF[kind]
            out.setdefault("collected", {})[kind] = collect_moe_aux_losses([router], grid)
    finally:
        destroy_model_parallel(grid)
    grid = initialize_model_parallel(ParallelConfig())  # dp = 2
    try:
        r = grid.rank("dp")
        router = make_router(
            moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True,
            moe_aux_loss_coeff=0.1,
        )
        x = hidden(seed=10 + r, s=4 + 4 * r)  # different token counts per rank
        router(x)
        out["dp_counts"] = router.local_tokens_per_expert.clone()
        out["dp_collected"] = collect_moe_aux_losses([router], grid)
        out["dp_lb"] = router.aux_loss_record.mean("load_balancing_loss")
        update_expert_bias([router], grid.group("tp-dp-cp"))
        out["bias"] = router.expert_bias.clone()
    finally:
        destroy_model_parallel(grid)
    return out


@pytest.fixture(scope="module")
def two_ranks(distributed):
    x_full = hidden(seed=5, s=8)
    kinds = list(CLOSED)
    return x_full, distributed.run(2, _two_rank_checks, x_full, kinds)


@pytest.mark.parametrize("kind", list(CLOSED))
def test_tp_cp_shares_sum_to_one_process(two_ranks, kind: str) -> None:
    x_full, ranks = two_ranks
    w = make_router(**ROUTER_KW[kind]).weight
    ref_value, ref_grad = closed_value_and_grad(kind, w, x_full)
    total = sum(rk["shares"][kind] for rk in ranks)
    torch.testing.assert_close(total, ref_value, rtol=RTOL, atol=0)
    grad = sum(rk["grads"][kind] for rk in ranks)
    torch.testing.assert_close(grad, ref_grad, rtol=RTOL, atol=1e-14)
    collected = [rk["collected"][kind][RECORD[kind]][0] for rk in ranks]
    for c in collected:  # the tracker sums the shares over tp-cp
        torch.testing.assert_close(c * COEFF[kind], ref_value, rtol=RTOL, atol=0)


def test_tracker_averages_over_dp(two_ranks) -> None:
    _, ranks = two_ranks
    mean = (ranks[0]["dp_lb"] + ranks[1]["dp_lb"]) / 2
    for rk in ranks:
        torch.testing.assert_close(rk["dp_collected"]["load_balancing_loss"][0], mean)


def test_expert_bias_identical_and_equal_to_rule(two_ranks) -> None:
    _, ranks = two_ranks
    assert not torch.equal(ranks[0]["dp_counts"], ranks[1]["dp_counts"])
    load = (ranks[0]["dp_counts"] + ranks[1]["dp_counts"]).double()
    expect = (1e-3 * torch.sign(load.mean() - load)).float()
    for rk in ranks:
        assert torch.equal(rk["bias"], expect)
    assert torch.equal(ranks[0]["bias"], ranks[1]["bias"])


def test_per_token_mode_scales_losses_by_local_tokens() -> None:
    kw = dict(ROUTER_KW["aux_loss"], moe_z_loss_coeff=0.01)
    router, x = make_router(**kw), hidden()
    base = aux_grad(router, x)
    router.calculate_per_token_loss = True  # the step then divides by the token total
    torch.testing.assert_close(aux_grad(router, x), base * (S * B), rtol=RTOL, atol=0)


def test_losses_flow_through_full_recompute_and_are_recorded_once() -> None:
    from pentatron.tp_layers import checkpoint

    kind = "aux_loss"
    router, x = make_router(**ROUTER_KW[kind]), hidden()
    x.requires_grad_(True)  # as a layer's hidden states: reentrant recompute needs one
    probs = checkpoint(lambda h: router(h)[0], x)
    (probs * 0).sum().backward()
    _, ref_grad = closed_value_and_grad(kind, router.weight, x)
    torch.testing.assert_close(router.weight.grad, ref_grad, rtol=RTOL, atol=1e-14)
    assert router.aux_loss_record.counts["load_balancing_loss"] == 1


@pytest.mark.parametrize("router_dtype, want", [(None, torch.bfloat16), ("fp32", torch.float32)])
def test_low_precision_params_route_in_the_router_dtype(router_dtype, want) -> None:
    """Megatron's moe_router_dtype: None keeps the input's dtype (see test_moe_router_dtype)."""
    router = make_router(params_dtype=torch.bfloat16, moe_router_dtype=router_dtype)
    probs, _ = router(hidden().to(torch.bfloat16))
    assert router.weight.dtype == torch.bfloat16 and probs.dtype == want
