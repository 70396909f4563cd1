"""`TopKRouter`: which experts each token goes to, with what weight, and the router's
load-balancing and z-losses (Megatron-LM's TopKRouter / topk_softmax_with_capacity).

    hidden [s/(t*cp), b, h] -> logits [T, E] (T = s_local * b, s-major; router dtype)
      -> (moe_router_force_load_balancing: replaced by N(0, 1) draws) -> z-loss attached
      -> scores (softmax pre/post top-k, or sigmoid normalised over the top-k) -> top-k
      (optionally group-limited, optionally chosen with the expert bias)
      -> * topk scaling factor -> capacity dropping -> aux loss attached
      -> probs [T, E] (router dtype, 0 off the route), routing_map [T, E] bool

Precision (`moe_router_dtype`, Megatron's --moe-router-dtype): the gating GEMM runs in the
router dtype (None: the input's dtype, e.g. bf16; "fp32"; "fp64") from the input and weight
as they are, which are what backward keeps (Megatron's RouterGatingLinearFunction). The
z-loss and the choice of post-softmax top-k read the logits in that dtype; the score
functions (softmax, sigmoid, the aux-loss scores, sinkhorn) run in at least fp32, as
Megatron's ("logits are converted to fp32 for score functions"; at fp64 Megatron's
`.float()` drops to fp32, here they stay fp64); probs are cast back to the logits' dtype,
and the dispatcher weights and sums the expert outputs in it (see token_dispatcher).

`moe_router_force_load_balancing` (benchmarking, Megatron's RandomSTE): the logits are
replaced by i.i.d. N(0, 1) draws from the tracker's expert-parallel RNG state, so each
token's top-k is a uniformly random k-subset and each expert's count is Binomial(T, k/E);
backward passes the logits' grad straight through to the gating GEMM.

Only the routing counts of the aux losses communicate: all-reduce over `tp_cp_group`
(tokens differ across tp x cp under sequence parallelism), so each rank's losses are
shares whose sum over the group is the loss of all the group's tokens.

Capacity is per rank, as in Megatron: ceil(T * topk / E * capacity_factor) over the T tokens
this rank routes, with no communication. Under tp > 1 (sequence parallel) or cp > 1 each
rank routes s/(t*cp) of a sequence, so which tokens drop differs from one process routing
the whole sequence; dropping equals a one-process run only where the router sees the same
token set (tp = cp = 1, any ep / etp / pp).

Expert-bias counts (`local_tokens_per_expert`): like Megatron, the assignments kept after
capacity dropping; unlike Megatron, padding slots are left out, since with padding every
expert would count exactly capacity and the bias would never move.
"""

from __future__ import annotations

from typing import Any

import torch

from pentatron.parallel_state import current_device
from pentatron.tp_layers import EXPERT_PARALLEL_RNG, get_rng_tracker

from ..config import TransformerConfig
from ..config_checks import ModelConfigError
from .aux_tracker import AuxLossRecord
from .capacity import drop_tokens
from .load_balancing import (
    attach_aux_loss,
    routing_scores_for_aux_loss,
    sequence_load_balancing_loss,
    sinkhorn,
    switch_load_balancing_loss,
    z_loss,
)

ROUTER_DTYPES: dict[str | None, torch.dtype | None] = {
    None: None,
    "fp32": torch.float32,
    "fp64": torch.float64,
}


def score_dtype(logits: torch.Tensor) -> torch.dtype:
    """The dtype score functions run in: the logits' dtype, at least fp32."""
    return torch.promote_types(logits.dtype, torch.float32)


class RouterGatingLinear(torch.autograd.Function):
    """`x [T, h] @ weight [E, h]^T (+ bias [E])` in `dtype`, keeping `x` and `weight` as they
    are for backward (not their `dtype` copies); grads are computed in `dtype` and returned
    in the inputs' dtypes (Megatron's RouterGatingLinearFunction)."""

    @staticmethod
    def forward(
        ctx,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.dtype, ctx.bias_dtype = dtype, None if bias is None else bias.dtype
        if bias is None:
            return torch.mm(x.to(dtype), weight.to(dtype).t())
        return torch.addmm(bias.to(dtype), x.to(dtype), weight.to(dtype).t())

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad = grad.to(ctx.dtype)
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = torch.mm(grad, weight.to(ctx.dtype)).to(x.dtype)
        if ctx.needs_input_grad[1]:
            dw = torch.mm(grad.t(), x.to(ctx.dtype)).to(weight.dtype)
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            db = grad.sum(dim=0).to(ctx.bias_dtype)
        return dx, dw, db, None


class RandomSTE(torch.autograd.Function):
    """Forward: N(0, 1) logits of the same shape and dtype, drawn in the tracker's
    expert-parallel RNG state; backward: the grad passes through unchanged (Megatron's
    RandomSTE for --moe-router-force-load-balancing)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor) -> torch.Tensor:
        with get_rng_tracker().fork(EXPERT_PARALLEL_RNG):
            return logits.clone().normal_()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


def group_limited_topk(
    scores: torch.Tensor, topk: int, num_groups: int, group_topk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of `scores [T, E]` restricted to the `group_topk` best of `num_groups` groups of
    consecutive experts; a group's score is the sum of its top (topk // group_topk) scores.
    Returns (top scores [T, k], expert indices [T, k])."""
    num_tokens, num_experts = scores.shape
    grouped = scores.view(num_tokens, num_groups, num_experts // num_groups)
    group_scores = grouped.topk(topk // group_topk, dim=-1).values.sum(dim=-1)
    groups = torch.topk(group_scores, k=group_topk, dim=-1, sorted=False).indices
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, groups, True)
    expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(num_tokens, num_experts)
    masked = scores.masked_fill(~expert_mask, float("-inf"))
    return torch.topk(masked, k=topk, dim=-1)


def topk_routing(
    logits: torch.Tensor, config: TransformerConfig, expert_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`[T, E]` logits -> (probs `[T, E]`, 0 off the route; routing_map `[T, E]` bool)."""
    topk = config.moe_router_topk

    def choose(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if config.moe_router_group_topk:
            num_groups = config.moe_router_num_groups
            assert num_groups is not None, "check_moe: group_topk needs num_groups"
            return group_limited_topk(scores, topk, num_groups, config.moe_router_group_topk)
        return torch.topk(scores, k=topk, dim=-1)

    sd = score_dtype(logits)  # score functions run in at least fp32 (Megatron)
    if config.moe_router_score_function == "softmax":
        if config.moe_router_pre_softmax:
            top, indices = choose(torch.softmax(logits, dim=-1, dtype=sd))
        else:
            top, indices = choose(logits)
            top = torch.softmax(top, dim=-1, dtype=sd)
    else:
        scores = torch.sigmoid(logits.to(sd))
        if expert_bias is not None:  # the bias picks the experts; the probs stay unbiased
            _, indices = choose(scores + expert_bias.to(sd))
            top = torch.gather(scores, 1, indices)
        else:
            top, indices = choose(scores)
        if topk > 1:
            top = top / (top.sum(dim=-1, keepdim=True) + 1e-20)
    if config.moe_router_topk_scaling_factor:
        top = top * config.moe_router_topk_scaling_factor
    probs = torch.zeros_like(logits).scatter(1, indices, top.to(logits.dtype))
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, indices, True)
    return probs, routing_map


def _check_router_config(config: TransformerConfig) -> None:
    if not config.is_moe:
        raise ModelConfigError(
            "num_moe_experts=None: the rule: a TopKRouter needs experts; fix: set num_moe_experts"
        )
    if config.moe_router_enable_expert_bias and config.moe_router_score_function != "sigmoid":
        raise ModelConfigError(
            "moe_router_enable_expert_bias=True: the rule: the expert bias (aux-loss-free "
            "balancing) works with the sigmoid score function (as Megatron); fix: set "
            "moe_router_score_function='sigmoid' or moe_router_enable_expert_bias=False"
        )
    group_topk = config.moe_router_group_topk
    if group_topk and config.moe_router_topk < group_topk:
        raise ModelConfigError(
            f"moe_router_group_topk={group_topk}: the rule: a group is scored by its top "
            f"(topk // group_topk) experts, so moe_router_topk={config.moe_router_topk} must "
            "be >= moe_router_group_topk; fix: lower moe_router_group_topk"
        )


class TopKRouter(torch.nn.Module):
    """Route each of this rank's tokens to its top-k experts (see the module docstring).

    Parameter `weight [E, h]` (params_dtype, N(0, init_method_std^2) from the default RNG,
    `sequence_parallel = config.sequence_parallel` so its tp-partial grad is all-reduced),
    and with `add_bias_linear` (Megatron's default) a logit bias `bias [E]`, drawn and
    tagged the same way (gpt-oss's router has one).
    Buffers with `moe_router_enable_expert_bias`: `expert_bias [E]` (fp32, persistent) and
    `local_tokens_per_expert [E]` (fp32, not persistent: counts since the last bias update);
    both are None otherwise. `aux_loss_record` holds the losses for logging.
    `calculate_per_token_loss` (default: the config's field if it has one) multiplies the
    attached losses by the local token count, as the step then divides by the token total.
    """

    def __init__(self, config: TransformerConfig, layer_number: int, tp_cp_group: Any = None):
        super().__init__()
        _check_router_config(config)
        self.config, self.layer_number, self.tp_cp_group = config, layer_number, tp_cp_group
        experts, hidden = config.num_moe_experts, config.hidden_size
        assert experts is not None, "_check_router_config raised on num_moe_experts=None"
        device = current_device()
        self.weight = torch.nn.Parameter(
            torch.empty(experts, hidden, dtype=config.params_dtype, device=device)
        )
        with torch.no_grad():
            self.weight.normal_(0.0, config.init_method_std)
        self.weight.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]  # a Parameter tag
        self.bias: torch.nn.Parameter | None = None
        if config.add_bias_linear:  # Megatron: a learned logit bias, drawn like the weight
            self.bias = torch.nn.Parameter(
                torch.empty(experts, dtype=config.params_dtype, device=device)
            )
            with torch.no_grad():
                self.bias.normal_(0.0, config.init_method_std)
            self.bias.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]
        if config.moe_router_enable_expert_bias:
            self.register_buffer(
                "expert_bias", torch.zeros(experts, dtype=torch.float32, device=device)
            )
            self.register_buffer(
                "local_tokens_per_expert",
                torch.zeros(experts, dtype=torch.float32, device=device),
                persistent=False,
            )
        else:
            self.expert_bias = None
            self.local_tokens_per_expert = None
        self.calculate_per_token_loss = bool(getattr(config, "calculate_per_token_loss", False))
        self.aux_loss_record = AuxLossRecord()

    @property
    def tp_cp_size(self) -> int:
        group = self.tp_cp_group
        if group is None or not torch.distributed.is_initialized():
            return 1
        return torch.distributed.get_world_size(group)

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden `[s_local, b, h]` -> probs `[T, E]` in the router dtype, routing_map
        `[T, E]` bool; T = s_local * b in s-major order (hidden.reshape(-1, h))."""
        self._check_input(hidden)
        self._keep_buffers_fp32()
        batch_size = hidden.shape[1]
        logits = self._gating(hidden.reshape(-1, hidden.shape[-1]))
        if self.config.moe_router_force_load_balancing:
            logits = RandomSTE.apply(logits)
        logits = self._apply_z_loss(logits)
        if self.config.moe_router_load_balancing_type == "sinkhorn":
            probs, routing_map = self._sinkhorn_routing(logits)
            routed = routing_map
        else:
            probs, routed = topk_routing(logits, self.config, self.expert_bias)
            probs, routing_map = self._apply_capacity(probs, routed)
            probs = self._apply_load_balancing_loss(probs, logits, batch_size)
        self._count_for_expert_bias(routed, routing_map)
        return probs, routing_map

    def _count_for_expert_bias(self, routed: torch.Tensor, routing_map: torch.Tensor) -> None:
        """Add the kept real assignments `routed & routing_map` (`[T, E]` bool) per expert:
        Megatron's post-dropping count without the padding slots (see the module docstring)."""
        if self.local_tokens_per_expert is None or not torch.is_grad_enabled():
            return  # no_grad passes (evaluation, the first pass of full recompute) do not count
        self.local_tokens_per_expert += (routed & routing_map).sum(dim=0).float()

    # --- pieces of forward ---------------------------------------------------------------
    def _check_input(self, hidden: torch.Tensor) -> None:
        h = self.config.hidden_size
        if not torch.is_tensor(hidden) or hidden.dim() != 3 or hidden.shape[-1] != h:
            shape = tuple(hidden.shape) if torch.is_tensor(hidden) else type(hidden).__name__
            raise ValueError(
                f"TopKRouter(layer {self.layer_number}) got hidden of shape {shape}; the rule: "
                f"[s_local, b, hidden_size={h}]; fix: pass the layer's [s/(tp*cp), b, h] tokens"
            )
        if not hidden.is_floating_point():
            raise ValueError(f"TopKRouter got hidden of dtype {hidden.dtype}; needs a float")

    def _keep_buffers_fp32(self) -> None:
        """model.to(bf16) casts buffers too; the bias and counts must stay exact in fp32."""
        for name in ("expert_bias", "local_tokens_per_expert"):
            buf = getattr(self, name)
            if buf is not None and buf.dtype != torch.float32:
                buf.data = buf.data.float()

    def _gating(self, x: torch.Tensor) -> torch.Tensor:
        """`[T, h]` -> logits `[T, E]` in the router dtype (`moe_router_dtype`; None: x's)."""
        dtype = ROUTER_DTYPES[self.config.moe_router_dtype] or x.dtype
        eps = self.config.moe_input_jitter_eps
        if eps is not None and self.training:  # multiplicative noise U(1-eps, 1+eps)
            x = x * torch.empty_like(x).uniform_(1.0 - eps, 1.0 + eps)
        return RouterGatingLinear.apply(x, self.weight, self.bias, dtype)

    def _loss_scale_up(self, loss: torch.Tensor, num_tokens: int) -> torch.Tensor:
        return loss * num_tokens if self.calculate_per_token_loss else loss

    def _apply_z_loss(self, logits: torch.Tensor) -> torch.Tensor:
        coeff = self.config.moe_z_loss_coeff
        if coeff is None or not (self.training and torch.is_grad_enabled()):
            return logits
        # each rank's mean over its tokens / |tp-cp|: the shares sum to the group's mean
        share = z_loss(logits, coeff / self.tp_cp_size)
        self.aux_loss_record.record("z_loss", share / coeff)
        return attach_aux_loss(logits, self._loss_scale_up(share, logits.shape[0]))

    def _sinkhorn_routing(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        topk = self.config.moe_router_topk

        def activation(x: torch.Tensor) -> torch.Tensor:
            if topk == 1:
                return torch.sigmoid(x)
            return torch.softmax(x, dim=-1, dtype=score_dtype(x)).type_as(x)

        if self.training:  # experts chosen by the balanced matrix, weighted by the plain one
            with torch.no_grad():
                balanced = sinkhorn(logits.detach().to(score_dtype(logits)))
                indices = torch.topk(balanced, k=topk, dim=-1).indices
            scores = activation(logits)
        else:
            scores = activation(logits)
            indices = torch.topk(scores, k=topk, dim=-1).indices
        routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, indices, True)
        return scores * routing_map, routing_map

    def _apply_capacity(
        self, probs: torch.Tensor, routing_map: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        if c.moe_expert_capacity_factor is None:
            return probs, routing_map
        return drop_tokens(
            probs,
            routing_map,
            c.moe_router_topk,
            c.moe_expert_capacity_factor,
            c.moe_token_drop_policy,
            c.moe_pad_expert_input_to_capacity,
        )

    def _apply_load_balancing_loss(
        self, probs: torch.Tensor, logits: torch.Tensor, batch_size: int
    ) -> torch.Tensor:
        c = self.config
        kind, coeff, topk = (
            c.moe_router_load_balancing_type,
            c.moe_aux_loss_coeff,
            c.moe_router_topk,
        )
        if kind == "none" or not coeff or not (self.training and torch.is_grad_enabled()):
            return probs
        scores, topk_map = routing_scores_for_aux_loss(logits, topk, c.moe_router_score_function)
        if kind == "aux_loss":
            share = switch_load_balancing_loss(scores, topk_map, topk, coeff, self.tp_cp_group)
        else:
            share = sequence_load_balancing_loss(
                scores, topk_map, batch_size, topk, coeff, self.tp_cp_group
            )
        # Megatron's logged names: load_balancing_loss, seq_load_balancing_loss
        name = "load_balancing_loss" if kind == "aux_loss" else "seq_load_balancing_loss"
        self.aux_loss_record.record(name, share / coeff)
        return attach_aux_loss(probs, self._loss_scale_up(share, probs.shape[0]))
