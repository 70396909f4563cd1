"""`recompute_modules` with `recompute_granularity="selective"` (Megatron's names): for
each module, with dropout on, the grads equal (torch.equal) those without recompute; the
recomputed module runs twice per micro-batch (once under no_grad, or once more in
backward), every other once; and the bytes autograd keeps alive after forward drop.

Kept bytes are the unique storages saved for backward, read after forward (so an
output-discarding checkpoint's freed storage counts 0), parameters excluded. Measured
drops (fp32, s=16, b=2, h=32): core_attn 221184, mlp 131072, layernorm 33792, moe 127824,
moe_act 16384, shared_experts 32768 bytes. "mla_up_proj" (MLA) frees q, k, v and RoPE's
intermediates, which the core attention would keep. "layernorm" drops exactly each recomputed
norm's output `[s, b, h]` and fp32 rstd `[s, b, 1]` (its saved input is the residual
stream, kept either way); "moe_act" exactly fc2's input and silu(gate) `[s b k, F]`.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from _gpt import VOCAB, B, S, microbatches, small_config
from _moe import moe_config, moe_spec

from pentatron.models import GPTModel, ModelConfigError, get_gpt_layer_local_spec
from pentatron.models.moe.experts import SequentialMLP, grouped_mm_supported
from pentatron.models.moe.moe_layer import MoELayer
from pentatron.tp_layers import init_method_normal, model_parallel_seed

DROPOUT = dict(attention_dropout=0.2, hidden_dropout=0.2)
M = 2  # micro-batches


def _dense():
    return small_config(**DROPOUT)


def _moe():
    return moe_config(
        **DROPOUT,
        moe_grouped_gemm=True,
        moe_shared_expert_intermediate_size=32,
        moe_aux_loss_coeff=0.01,
    )


def _mla():
    mla = dict(q_lora_rank=16, kv_lora_rank=12, qk_head_dim=8, qk_pos_emb_head_dim=4)
    return small_config(**DROPOUT, multi_latent_attention=True, v_head_dim=6, **mla)


def _mla_spec():
    return get_gpt_layer_local_spec(multi_latent_attention=True)


def _count(counts, key):
    def hook(module, args, output):
        n, ng = counts.get(key, (0, 0))
        counts[key] = (n + 1, ng + (not torch.is_grad_enabled()))

    return hook


def _instrument(model):
    """Forward counts (calls, calls under no_grad) per (layer, part)."""
    counts: dict[tuple[int, str], tuple[int, int]] = {}
    for i, layer in enumerate(model.decoder.layers):
        parts = {
            "core_attn": layer.self_attention.core_attention,
            "layernorm": layer.input_layernorm,
            "mlp": layer.mlp,
        }
        if hasattr(layer.self_attention, "linear_kv_up_proj"):  # MLA
            parts["mla_up_proj"] = layer.self_attention.linear_kv_up_proj
        if isinstance(layer.mlp, MoELayer):
            parts["moe"] = layer.mlp.router  # runs inside the checkpointed MoE forward
            parts["shared_experts"] = layer.mlp.shared_experts
            experts = layer.mlp.experts
            act = experts.activation

            def counted(h, _act=act, _key=(i, "moe_act")):
                _count(counts, _key)(None, None, None)
                return _act(h)

            experts.activation = counted
        for name, module in parts.items():
            module.register_forward_hook(_count(counts, (i, name)))
    return counts


def _run(config, spec):
    grouped_mm_supported(torch.zeros(1, 16))  # its one-off probe must not count as saved
    model_parallel_seed(77, tp_rank=0)
    model = GPTModel(config, spec, VOCAB, S)
    counts = _instrument(model)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept_bytes = []
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    for ids, pos, labels in microbatches(M):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(ids, pos, labels=labels).mean()
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved}
        kept_bytes.append(sum(n for p, n in storages.items() if p not in params))
        saved.clear()
        loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return grads, counts, kept_bytes[0]


CASES = {  # module -> (config, spec builder)
    "core_attn": (_dense, get_gpt_layer_local_spec),
    "mlp": (_dense, get_gpt_layer_local_spec),
    "layernorm": (_dense, get_gpt_layer_local_spec),
    "moe": (_moe, moe_spec),
    "moe_act": (_moe, moe_spec),
    "shared_experts": (_moe, moe_spec),
    "mla_up_proj": (_mla, _mla_spec),
}
_BASELINE: dict[str, tuple] = {}


def _baseline(kind):
    config, spec = CASES[kind]
    if config.__name__ not in _BASELINE:
        _BASELINE[config.__name__] = _run(config(), spec())
    return _BASELINE[config.__name__]


@pytest.mark.parametrize("module", list(CASES))
def test_each_module_recomputes_alone_with_equal_grads(module):
    make_config, spec = CASES[module]
    ref_grads, ref_counts, ref_kept = _baseline(module)
    config = dataclasses.replace(
        make_config(), recompute_granularity="selective", recompute_modules=[module]
    )
    grads, counts, kept = _run(config, spec())
    for name, g in ref_grads.items():
        assert torch.equal(grads[name], g), f"{module}: {name}"
    assert any(n > 1 for n, _ in counts.values()), f"{module}: nothing recomputed"
    for (layer, part), (n, no_grad) in counts.items():
        again = part == module or (module == "moe" and part in ("shared_experts", "moe_act"))
        assert n == (2 if again else 1) * M, f"{module}: layer {layer} {part} ran {n}x"
        # checkpoint's first pass runs under no_grad; the output-discarding one as well
        assert no_grad == (M if again else 0), f"{module}: layer {layer} {part}"
        assert ref_counts[(layer, part)] == (M, 0)
    assert kept < ref_kept, f"{module}: keeps {kept} bytes, no recompute {ref_kept}"
    c = make_config()
    if module == "layernorm":
        per_norm = S * B * c.hidden_size * 4 + S * B * 4  # output + fp32 rstd
        assert ref_kept - kept == 2 * c.num_layers * per_norm
    if module == "moe_act":  # fc2's input and (unfused SwiGLU) silu(gate): [S B k, F] each
        assert ref_kept - kept == c.num_layers * 2 * S * B * c.moe_router_topk * c.moe_ffn_size * 4


def test_modules_combine_and_default_is_core_attention():
    config = dataclasses.replace(
        _moe(),
        recompute_granularity="selective",
        recompute_modules=["core_attn", "layernorm", "moe", "moe_act", "shared_experts"],
    )
    ref_grads = _baseline("moe")[0]
    grads, _, _ = _run(config, moe_spec())
    for name, g in ref_grads.items():
        assert torch.equal(grads[name], g), name
    assert small_config(recompute_granularity="selective").recompute_modules == ["core_attn"]


def test_sequential_experts_recompute_the_activation_too():
    """GroupedMLP falls back to SequentialMLP's loop where grouped GEMM cannot run; the loop
    recomputes the activation (once over all experts' rows: it is row-wise)."""
    config = dataclasses.replace(
        _moe(), recompute_granularity="selective", recompute_modules=["moe_act"]
    )
    calls = []
    torch.manual_seed(0)
    experts = SequentialMLP(config, 8, init_method=init_method_normal(0.1))
    act = experts.activation
    experts.activation = lambda h: calls.append(torch.is_grad_enabled()) or act(h)
    x = torch.randn(12, config.hidden_size, requires_grad=True)
    counts = [3, 0, 2, 1, 2, 1, 1, 2]
    experts(x, counts).square().sum().backward()
    ref = SequentialMLP(config, 8, init_method=init_method_normal(0.1))
    ref.load_state_dict(experts.state_dict())
    x2 = x.detach().requires_grad_()
    ref.eval()  # no recompute
    ref(x2, counts).square().sum().backward()
    assert torch.equal(x.grad, x2.grad)
    assert calls == [False, True]  # in forward (output discarded), again in backward


@pytest.mark.parametrize(
    "modules, match",
    [
        (["mla_up_proj"], "'mla_up_proj' recomputes multi-latent attention"),
        (["gdn_norm_out"], "GatedDeltaNet attention.*not in this release"),
        (["core_attn", "attn"], "'attn' is not a module name"),
        ("core_attn", "a list of module names"),
        (["moe_act"], "needs moe_grouped_gemm=True"),
    ],
)
def test_bad_recompute_modules_name_the_field(modules, match):
    with pytest.raises(ModelConfigError, match=r"recompute_modules=.*" + match):
        small_config(recompute_granularity="selective", recompute_modules=modules)


def test_shared_experts_recompute_refused_with_overlap():
    with pytest.raises(ModelConfigError, match=r"recompute_modules.*moe_shared_expert_overlap"):
        moe_config(
            moe_shared_expert_intermediate_size=32,
            moe_shared_expert_overlap=True,
            moe_token_dispatcher_type="alltoall",
            recompute_granularity="selective",
            recompute_modules=["shared_experts"],
        )


def test_modules_are_read_only_with_selective_granularity():
    """As Megatron: without selective recompute the list is not checked or used."""
    config = small_config(recompute_modules=["mla_up_proj"])
    assert config.recompute_granularity is None
