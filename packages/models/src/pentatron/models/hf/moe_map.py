"""Hugging Face Mixtral / Qwen2-MoE MoE tensors <-> our MoE-layer parameters.

Global MoE layer i, E experts, F = moe_ffn_hidden_size, S = shared-expert size:

DeepSeek-V3 (model.layers.{i}.mlp.) is Qwen2-MoE's layout with `shared_experts.` for the
shared expert (no gate) and `gate.e_score_correction_bias` for our `router.expert_bias`.

    ours (decoder.layers.{i}.mlp.)        HF Mixtral (model.layers.{i}.)   HF Qwen2-MoE (model.layers.{i}.)
    router.weight [E, h]                  {moe}.gate.weight                mlp.gate.weight
    experts.linear_fc1.weight [E, 2F, h]  fused: mlp.experts.gate_up_proj [E, 2F, h] (gate rows, then up)
                                          per expert: {moe}.experts.{e}.w1 / w3    mlp.experts.{e}.gate_proj / up_proj
    experts.linear_fc2.weight [E, h, F]   fused: mlp.experts.down_proj [E, h, F]
                                          per expert: {moe}.experts.{e}.w2         mlp.experts.{e}.down_proj
    shared_experts.linear_fc1 [2S, h]     -                                mlp.shared_expert.{gate,up}_proj
    shared_experts.linear_fc2 [h, S]      -                                mlp.shared_expert.down_proj
    shared_experts.gate_weight [1, h]     -                                mlp.shared_expert_gate.weight

Two HF layouts exist. transformers >= 5 holds the experts fused in memory
(`experts.gate_up_proj`, `experts.down_proj`, Mixtral's block renamed `mlp`); its
`save_pretrained` writes, and transformers 4 holds, one tensor per expert (`FUSED` vs
`PER_EXPERT`; Mixtral's block is then `block_sparse_moe`). Reading detects the layout per
layer from the source's keys; writing takes it as an argument.

Sharded reads: ep rank r takes experts r*E/ep ... (r+1)*E/ep - 1 and, of each, etp rank q's
rows of gate and of up (`[gate_q; up_q]`, like the dense fc1 at tp) and columns of down;
the shared expert is split over tp like the dense MLP. Only those slices are read.
"""

from __future__ import annotations

import importlib.metadata

import torch

from ..config import TransformerConfig

FUSED, PER_EXPERT = "fused", "per_expert"
LAYOUTS = (FUSED, PER_EXPERT)
_EXPERT_LINEARS = {
    "mixtral": ("w1", "w3", "w2"),
    "qwen2_moe": ("gate_proj", "up_proj", "down_proj"),
    "deepseek_v3": ("gate_proj", "up_proj", "down_proj"),
}
_SHARED = "mlp.shared_expert."


def hf_arch(config: TransformerConfig) -> str:
    """ "deepseek_v3" (multi-latent attention), "gpt_oss" (quick-GeGLU; its tensors:
    gpt_oss_map), "llama" (dense), "mixtral" (MoE, no shared expert) or "qwen2_moe" (shared
    expert)."""
    if config.multi_latent_attention:
        return "deepseek_v3"
    if config.activation == "quick_geglu":
        return "gpt_oss"
    if not config.is_moe:
        return "llama"
    return "mixtral" if config.moe_shared_expert_intermediate_size is None else "qwen2_moe"


def default_expert_layout() -> str:
    """The layout of the installed transformers' modules (fused from 5.0); no transformers:
    the checkpoint-file layout every version reads."""
    try:
        major = int(importlib.metadata.version("transformers").split(".")[0])
    except importlib.metadata.PackageNotFoundError:
        return PER_EXPERT
    return FUSED if major >= 5 else PER_EXPERT


def _block(arch: str, layer: int, layout: str) -> str:
    name = "block_sparse_moe" if arch == "mixtral" and layout == PER_EXPERT else "mlp"
    return f"model.layers.{layer}.{name}."


def expert_keys(arch: str, layer: int, layout: str, expert: int | None = None) -> list[str]:
    """Fused: [gate_up, down]; per expert (expert e): [gate, up, down]."""
    pre = _block(arch, layer, layout)
    if layout == FUSED:
        return [pre + "experts.gate_up_proj", pre + "experts.down_proj"]
    return [f"{pre}experts.{expert}.{n}.weight" for n in _EXPERT_LINEARS[arch]]


def detect_layout(keys: set[str], arch: str, layer: int) -> str:
    """The expert layout of MoE layer `layer` in a source holding `keys`."""
    for layout in LAYOUTS:
        if expert_keys(arch, layer, layout, 0)[0] in keys:
            return layout
    want = [expert_keys(arch, layer, lay, 0)[0] for lay in LAYOUTS]
    raise KeyError(
        f"Hugging Face tensors have neither {want[0]!r} nor {want[1]!r}; the rule: layer "
        f"{layer} is a MoE layer of a {arch} checkpoint (moe_layer_freq); fix: check the "
        "checkpoint against its config.json"
    )


def moe_hf_names(suffix: str, arch: str, layer: int, config: TransformerConfig, layout: str):
    """The HF tensors our MoE parameter `mlp.<suffix>` of global layer `layer` comes from."""
    pre = f"model.layers.{layer}."
    if suffix == "router.weight":
        return [_block(arch, layer, layout) + "gate.weight"]
    if suffix.startswith("experts.linear_fc"):
        which = 0 if "linear_fc1" in suffix else 1
        if layout == FUSED:
            return [expert_keys(arch, layer, FUSED)[which]]
        picks = (0, 1) if which == 0 else (2,)
        experts = config.num_moe_experts
        assert experts is not None, "expert parameters exist only when num_moe_experts is set"
        return [expert_keys(arch, layer, PER_EXPERT, e)[p] for e in range(experts) for p in picks]
    if arch == "deepseek_v3":
        shared = pre + "mlp.shared_experts."
        if suffix == "router.expert_bias":
            return [pre + "mlp.gate.e_score_correction_bias"]
        if suffix == "shared_experts.linear_fc1.weight":
            return [shared + "gate_proj.weight", shared + "up_proj.weight"]
        if suffix == "shared_experts.linear_fc2.weight":
            return [shared + "down_proj.weight"]
    if arch == "qwen2_moe":
        if suffix == "shared_experts.linear_fc1.weight":
            return [pre + _SHARED + "gate_proj.weight", pre + _SHARED + "up_proj.weight"]
        if suffix == "shared_experts.linear_fc2.weight":
            return [pre + _SHARED + "down_proj.weight"]
        if suffix == "shared_experts.gate_weight":
            return [pre + "mlp.shared_expert_gate.weight"]
    raise KeyError(
        f"decoder.layers.{layer}.mlp.{suffix}: no Hugging Face {arch} counterpart; the rule: "
        "router.weight, experts.linear_fc1/2.weight and (Qwen2-MoE) shared_experts.*; fix: "
        "convert a model without expert biases or the expert bias buffer"
    )


def _part(total: int, rank: int, size: int, what: str) -> tuple[int, int]:
    if total % size:
        raise ValueError(f"{what}={total} does not split over {size} ranks")
    per = total // size
    return rank * per, (rank + 1) * per


def read_moe_shard(
    suffix: str,
    layer: int,
    src,
    config: TransformerConfig,
    *,
    tp_rank: int,
    tp_size: int,
    ep_rank: int,
    ep_size: int,
    etp_rank: int,
    etp_size: int,
) -> torch.Tensor:
    """This rank's part of `decoder.layers.{layer}.mlp.<suffix>`, reading only its slices.

    experts fc1 `[E/ep, 2F/etp, h]`, fc2 `[E/ep, h, F/etp]`, shared fc1 `[2S/tp, h]`,
    shared fc2 `[h, S/tp]`, router `[E, h]` and gate `[1, h]` whole.
    """
    arch = hf_arch(config)
    layout = detect_layout(src.keys(), arch, layer)  # Mixtral's router name depends on it too
    hf = moe_hf_names(suffix, arch, layer, config, layout)
    if suffix.startswith("experts."):
        experts = config.num_moe_experts
        assert experts is not None, "expert parameters exist only when num_moe_experts is set"
        e0, e1 = _part(experts, ep_rank, ep_size, "num_moe_experts")
        f = config.moe_ffn_size
        c0, c1 = _part(f, etp_rank, etp_size, "moe_ffn_hidden_size")
        fc1 = "linear_fc1" in suffix
        if layout == FUSED:
            if fc1:
                gate = src.read_box(hf[0], [(e0, e1), (c0, c1)])
                up = src.read_box(hf[0], [(e0, e1), (f + c0, f + c1)])
                return torch.cat([gate, up], dim=1)
            return src.read_box(hf[0], [(e0, e1), None, (c0, c1)])
        per = []
        for e in range(e0, e1):
            gate, up, down = expert_keys(arch, layer, PER_EXPERT, e)
            if fc1:
                per.append(torch.cat([src.read(gate, 0, c0, c1), src.read(up, 0, c0, c1)], 0))
            else:
                per.append(src.read(down, 1, c0, c1))
        return torch.stack(per, 0)
    if suffix.startswith("shared_experts.linear_fc"):
        shared = config.moe_shared_expert_intermediate_size
        assert shared is not None, "shared experts exist only when their size is set"
        s0, s1 = _part(shared, tp_rank, tp_size, "shared expert size")
        if "linear_fc1" in suffix:
            return torch.cat([src.read(hf[0], 0, s0, s1), src.read(hf[1], 0, s0, s1)], 0)
        return src.read(hf[0], 1, s0, s1)
    return src.read(hf[0])


def moe_full_to_hf(
    suffix: str, layer: int, t: torch.Tensor, config: TransformerConfig, layout: str
) -> dict[str, torch.Tensor]:
    """A full (tp=ep=1) MoE parameter -> its HF tensors in `layout`."""
    if layout not in LAYOUTS:
        raise ValueError(f"expert_layout={layout!r}; the rule: one of {LAYOUTS}")
    arch = hf_arch(config)
    hf = moe_hf_names(suffix, arch, layer, config, layout)
    if suffix.startswith("experts.") and layout == PER_EXPERT:
        if "linear_fc1" in suffix:
            halves = torch.chunk(t, 2, dim=1)  # [E, F, h] gate, [E, F, h] up
            return {hf[2 * e + j]: halves[j][e] for e in range(t.size(0)) for j in (0, 1)}
        return {hf[e]: t[e] for e in range(t.size(0))}
    if suffix == "shared_experts.linear_fc1.weight":
        gate, up = torch.chunk(t, 2, dim=0)
        return {hf[0]: gate, hf[1]: up}
    return {hf[0]: t}


def moe_param_suffixes(config: TransformerConfig) -> list[str]:
    """The `mlp.<suffix>` state-dict entries of one MoE layer, in GPTModel's order (biases:
    gpt-oss's; the other forms refuse `add_bias_linear`)."""
    bias = config.add_bias_linear
    names = ["router.weight"] + (["router.bias"] if bias else [])
    if config.moe_router_enable_expert_bias:
        names.append("router.expert_bias")
    for fc in ("experts.linear_fc1", "experts.linear_fc2"):
        names += [fc + ".weight"] + ([fc + ".bias"] if bias else [])
    if config.moe_shared_expert_intermediate_size is not None:
        names += ["shared_experts.linear_fc1.weight", "shared_experts.linear_fc2.weight"]
        if config.moe_shared_expert_gate:
            names.append("shared_experts.gate_weight")
    return names
