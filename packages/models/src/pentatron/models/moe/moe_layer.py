"""`MoELayer`: the MLP of a Mixture-of-Experts transformer layer.

    hidden [s/(t cp), b, h] -> router -> probs, routing_map [T, E]
      -> dispatcher.dispatch -> [N, h] by local expert -> experts -> dispatcher.combine
      -> [s/(t cp), b, h]  (+ shared experts on the same input)
returns `(output, None)` like `MLP` (the bias, if any, is inside the experts).

Selective recompute (recompute.py): "moe" checkpoints the whole layer (router, dispatch,
experts, combine, shared experts; the collectives run again in backward), "shared_experts"
the shared experts alone; "moe_act" lives in the experts.

Experts are split over the expert grid: ep rank r holds experts r*E/ep ... and etp splits
each like the dense MLP. `submodules` (MoESubmodules) name the router, the experts
(SequentialMLP or GroupedMLP; None: chosen by `config.moe_grouped_gemm`) and the shared
experts, so a spec can swap any of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pentatron.tp_layers import checkpoint

from ..recompute import recompute_now
from ..spec import build_module
from .experts import GroupedMLP, SequentialMLP
from .router import TopKRouter
from .shared_experts import SharedExpertMLP
from .token_dispatcher import MoEGroups, build_dispatcher


@dataclass
class MoESubmodules:
    router: Any = None  # None: moe.router.TopKRouter
    experts: Any = None  # None: GroupedMLP if config.moe_grouped_gemm else SequentialMLP
    shared_experts: Any = None  # None: SharedExpertMLP (built only with a shared size)


class MoELayer(torch.nn.Module):
    """Router -> dispatch -> experts -> combine (+ shared experts); see the module docstring.

    `parallel`: the chunk's `ModelParallel` (None: one process).
    """

    def __init__(
        self,
        config: Any,
        submodules: MoESubmodules | None = None,
        layer_number: int = 1,
        parallel: Any = None,
        tp_group: Any = None,
        init_method: Any = None,
        output_layer_init_method: Any = None,
    ) -> None:
        super().__init__()
        if not config.is_moe:
            raise ValueError(
                "MoELayer with num_moe_experts=None; the rule: a MoE layer needs experts; "
                "fix: set num_moe_experts or build the dense MLP"
            )
        sub = submodules or MoESubmodules()
        self.config, self.layer_number = config, layer_number
        self.groups = groups = MoEGroups.from_parallel(parallel)
        ep = config.expert_model_parallel_size
        self.num_local_experts = config.num_moe_experts // ep
        self.router = build_module(
            sub.router or TopKRouter,
            config,
            layer_number=layer_number,
            tp_cp_group=groups.tp_cp,
        )
        experts = sub.experts or (GroupedMLP if config.moe_grouped_gemm else SequentialMLP)
        self.experts = build_module(
            experts,
            config,
            self.num_local_experts,
            ep_rank=groups.ep_rank,
            etp_rank=groups.etp_rank,
            etp_size=config.expert_tp_size,
            init_method=init_method,
            output_layer_init_method=output_layer_init_method,
        )
        self.shared_experts: torch.nn.Module | None = None
        if config.moe_shared_expert_intermediate_size is not None:
            self.shared_experts = build_module(
                sub.shared_experts or SharedExpertMLP,
                config,
                tp_group=tp_group if tp_group is not None else groups.tp,
                init_method=init_method,
                output_layer_init_method=output_layer_init_method,
            )
        self.dispatcher = build_dispatcher(config, self.num_local_experts, groups)

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, None]:
        """`[s/(t cp), b, h]` -> (`[s/(t cp), b, h]`, None)."""
        if hidden.dim() != 3 or hidden.size(-1) != self.config.hidden_size:
            raise ValueError(
                f"MoELayer input {tuple(hidden.shape)}; the rule: [s_local, b, "
                f"hidden_size={self.config.hidden_size}]; fix: pass the layer's hidden states"
            )
        if recompute_now(self.config, "moe", self.training):
            return checkpoint(self._forward, hidden), None
        return self._forward(hidden), None

    def _forward(self, hidden: torch.Tensor) -> torch.Tensor:
        shared, stream = self._start_shared(hidden)
        probs, routing_map = self.router(hidden)
        tokens = hidden.reshape(-1, hidden.size(-1))
        x, tokens_per_expert, ctx = self.dispatcher.dispatch(tokens, probs, routing_map)
        y = self.experts(x, tokens_per_expert)
        out = self.dispatcher.combine(y, ctx).view_as(hidden)
        if self.shared_experts is not None:
            out = out + self._finish_shared(hidden, shared, stream)
        return out

    def _start_shared(self, hidden: torch.Tensor) -> tuple[Any, Any]:
        """With moe_shared_expert_overlap on CUDA: run the shared experts on a side stream
        while the dispatch communicates (not GPU-tested); otherwise run them later."""
        if self.shared_experts is None or not self.config.moe_shared_expert_overlap:
            return None, None
        if not hidden.is_cuda:
            return None, None  # CPU: sequential, identical numerics
        stream = torch.cuda.Stream(device=hidden.device)
        stream.wait_stream(torch.cuda.current_stream(hidden.device))
        with torch.cuda.stream(stream):
            shared = self.shared_experts(hidden)
        return shared, stream

    def _finish_shared(self, hidden: torch.Tensor, shared: Any, stream: Any) -> torch.Tensor:
        if stream is None:
            assert self.shared_experts is not None, "called only with shared experts"
            if recompute_now(self.config, "shared_experts", self.training):
                return checkpoint(self.shared_experts, hidden)
            return self.shared_experts(hidden)
        torch.cuda.current_stream(hidden.device).wait_stream(stream)
        shared.record_stream(torch.cuda.current_stream(hidden.device))
        return shared
