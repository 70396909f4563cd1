"""Hugging Face Llama / Mixtral / Qwen2-MoE / DeepSeek-V3 / gpt-oss tensors <-> GPTModel
parameters, as pure functions of the config (the MoE layer's tensors: `moe_map`, gpt-oss's
`gpt_oss_map`; attention, norms, embeddings and dense MLPs are the same in all of them).

Global layer i (HF `model.layers.{i}`, ours `decoder.layers.{i}` of the full model):

    ours                                          Hugging Face
    embedding.word_embeddings.weight  [Vp, h]     model.embed_tokens.weight [V, h] (+ zero rows)
    ...input_layernorm.weight                     ...input_layernorm.weight
    ...self_attention.linear_qkv.{weight,bias}    ...self_attn.{q,k,v}_proj (per query group)
    ...self_attention.core_attention.softmax_offset  ...self_attn.sinks (gpt-oss; by heads)
    ...self_attention.linear_proj.{weight,bias}   ...self_attn.o_proj
    ...pre_mlp_layernorm.weight                   ...post_attention_layernorm.weight
    ...mlp.linear_fc1.{weight,bias}               cat([...mlp.gate_proj, ...mlp.up_proj])
    ...mlp.linear_fc2.{weight,bias}               ...mlp.down_proj
    decoder.final_layernorm.weight                model.norm.weight
    output_layer.weight               [Vp, h]     lm_head.weight (tied: model.embed_tokens.weight)

DeepSeek-V3 (multi-latent attention; `hf_arch(config) == "deepseek_v3"`): each MLA linear is
one HF tensor, split over tp by rows (column-parallel, `_MLA`) but the down-projections,
which every tp rank holds whole (duplicated), and `linear_proj` by columns:

    ...self_attention.linear_q_proj.weight        ...self_attn.q_proj.weight (no q latent)
    ...self_attention.linear_q_down_proj.weight   ...self_attn.q_a_proj.weight
    ...self_attention.q_layernorm.weight          ...self_attn.q_a_layernorm.weight
    ...self_attention.linear_q_up_proj.weight     ...self_attn.q_b_proj.weight
    ...self_attention.linear_kv_down_proj.weight  ...self_attn.kv_a_proj_with_mqa.weight
    ...self_attention.kv_layernorm.weight         ...self_attn.kv_a_layernorm.weight
    ...self_attention.linear_kv_up_proj.weight    ...self_attn.kv_b_proj.weight
    mtp.layers.{k}.enorm / hnorm / eh_proj        model.layers.{L + k}.enorm / hnorm / eh_proj
    mtp.layers.{k}.final_layernorm.weight         model.layers.{L + k}.shared_head.norm.weight
    mtp.layers.{k}.mtp_model_layer.<x>            model.layers.{L + k}.<x's HF name>
An exported MTP layer also carries DeepSeek's copies of the embedding and output layer
(`model.layers.{L + k}.embed_tokens.weight`, `.shared_head.head.weight`); an import reads
the model's own.

QKV is laid out per query group g: its nq/ng query heads, then k_g, then v_g, so rows of
group g are `q[g*qpg*d:(g+1)*qpg*d], k[g*d:(g+1)*d], v[g*d:(g+1)*d]` (HF's grouped
attention repeats kv head g for query heads g*qpg ... (g+1)*qpg-1, the same grouping).
RoPE is rotate-half on both sides, so q/k rows map without permutation.

`read_shard` builds tp rank r's part of one parameter straight from the HF tensors, reading
only the rows/columns that rank owns (`TensorSource.read` slices; a safetensors source reads
just that slice from disk). `full_to_hf` is the inverse on full (tp=1) tensors.

With `config.layernorm_zero_centered_gamma` our norm weights hold `gamma - 1` (the norm
scales by `1 + w`) while Hugging Face's hold gamma: `full_to_hf` writes `w + 1` and
`read_shard` reads `gamma - 1` (`norm_weight_to_hf` / `norm_weight_from_hf`, in fp32).
"""

from __future__ import annotations

import re
from typing import Protocol

import torch

from ..config import TransformerConfig
from .gpt_oss_map import (
    SINKS_HF,
    SINKS_SUFFIX,
    gpt_oss_hf_names,
    gpt_oss_moe_full_to_hf,
    read_gpt_oss_moe_shard,
)
from .moe_map import (
    default_expert_layout,
    hf_arch,
    moe_full_to_hf,
    moe_hf_names,
    moe_param_suffixes,
    read_moe_shard,
)

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")

# Our per-layer suffix -> HF per-layer suffix (the one-to-one tensors).
_LAYER_DIRECT = {
    "input_layernorm.weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.linear_proj.bias": "self_attn.o_proj.bias",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    "mlp.linear_fc2.bias": "mlp.down_proj.bias",
}
_ROW_PARALLEL = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")
# multi-latent attention (DeepSeek-V3): ours -> HF per-layer suffix; the linears split by rows,
# but the down-projections (duplicated over tp)
_MLA_DUPLICATED = (
    "self_attention.linear_q_down_proj.weight",
    "self_attention.linear_kv_down_proj.weight",
)
_MLA = {
    "self_attention.linear_q_proj.weight": "self_attn.q_proj.weight",
    "self_attention.linear_q_down_proj.weight": "self_attn.q_a_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_a_layernorm.weight",
    "self_attention.linear_q_up_proj.weight": "self_attn.q_b_proj.weight",
    "self_attention.linear_kv_down_proj.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "self_attention.kv_layernorm.weight": "self_attn.kv_a_layernorm.weight",
    "self_attention.linear_kv_up_proj.weight": "self_attn.kv_b_proj.weight",
}
_MTP = re.compile(r"^mtp\.layers\.(\d+)\.(.+)$")
_MTP_OWN = {  # an MTP depth's own tensors (its transformer layer maps like a decoder layer's)
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "eh_proj.weight": "eh_proj.weight",
    "final_layernorm.weight": "shared_head.norm.weight",
}
EMBED, LM_HEAD, FINAL_NORM = "model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"


def _is_norm_weight(name: str) -> bool:
    """input/pre-MLP/final (and q/k) norm weights: `...layernorm.weight`."""
    return name.endswith(("layernorm.weight", "enorm.weight", "hnorm.weight"))


def norm_weight_to_hf(name: str, t: torch.Tensor, config: TransformerConfig) -> torch.Tensor:
    """Our tensor `name` as HF holds it: a zero-centred norm weight + 1, else unchanged."""
    if config.layernorm_zero_centered_gamma and _is_norm_weight(name):
        return (t.float() + 1.0).to(t.dtype)
    return t


def norm_weight_from_hf(name: str, t: torch.Tensor, config: TransformerConfig) -> torch.Tensor:
    """HF's tensor for our `name`: - 1 for a zero-centred norm weight, else unchanged."""
    if config.layernorm_zero_centered_gamma and _is_norm_weight(name):
        return (t.float() - 1.0).to(t.dtype)
    return t


class TensorSource(Protocol):
    """Read access to named HF tensors, optionally one slice `[start, stop)` along `dim`."""

    def keys(self) -> set[str]: ...

    def read(
        self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None
    ) -> torch.Tensor: ...

    def read_box(self, name: str, box: list[tuple[int, int] | None]) -> torch.Tensor:
        """The slice `[start, stop)` per leading dim of `box` (None: the whole dim)."""
        ...


class DictSource:
    """A `TensorSource` over an in-memory state dict (slices are views)."""

    def __init__(self, state_dict: dict[str, torch.Tensor]) -> None:
        self.state_dict = state_dict

    def keys(self) -> set[str]:
        return set(self.state_dict)

    def read(
        self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None
    ) -> torch.Tensor:
        t = _get(self.state_dict, name)
        if dim is None:
            return t
        stop = t.size(dim) if stop is None else stop
        return t.narrow(dim, start, stop - start)

    def read_box(self, name: str, box: list[tuple[int, int] | None]) -> torch.Tensor:
        t = _get(self.state_dict, name)
        for dim, span in enumerate(box):
            if span is not None:
                t = t.narrow(dim, span[0], span[1] - span[0])
        return t


def _get(state_dict: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in state_dict:
        raise KeyError(
            f"Hugging Face state dict has no {name!r}; the rule: a state dict of the "
            "config's architecture; fix: check the checkpoint and its config.json"
        )
    return state_dict[name]


def _part(total: int, rank: int, size: int, what: str) -> tuple[int, int]:
    if total % size:
        raise ValueError(f"{what}={total} does not split over tp={size}")
    per = total // size
    return rank * per, (rank + 1) * per


def _moe_suffix(suffix: str) -> str | None:
    """`mlp.router.weight` -> `router.weight`; None for a dense-layer suffix."""
    for part in ("router.", "experts.", "shared_experts."):
        if suffix.startswith("mlp." + part):
            return suffix[len("mlp.") :]
    return None


def _mla_rows(suffix: str, config: TransformerConfig) -> int:
    """Output rows of MLA linear `suffix` (the dim tp splits)."""
    n, d_pe = config.num_attention_heads, config.qk_pos_emb_head_dim
    rows = {
        "linear_q_proj": n * (config.qk_head_dim + d_pe),
        "linear_q_up_proj": n * (config.qk_head_dim + d_pe),
        "linear_kv_up_proj": n * (config.qk_head_dim + config.v_head_dim),
    }
    return rows[suffix.split(".")[1]]


def as_decoder_name(name: str, config: TransformerConfig) -> str:
    """`mtp.layers.{k}.mtp_model_layer.<x>` -> `decoder.layers.{L + k}.<x>` (HF numbers the
    MTP layers after the decoder's); other names unchanged."""
    m = _MTP.match(name)
    if m and m.group(2).startswith("mtp_model_layer."):
        rest = m.group(2)[len("mtp_model_layer.") :]
        return f"decoder.layers.{config.num_layers + int(m.group(1))}.{rest}"
    return name


def hf_names_for(
    name: str, config: TransformerConfig, expert_layout: str | None = None
) -> list[str]:
    """The HF tensors parameter `name` (global layer index) is built from (MoE experts in
    `expert_layout`, default: the installed transformers')."""
    name = as_decoder_name(name, config)
    mtp = _MTP.match(name)
    if mtp:
        if mtp.group(2) not in _MTP_OWN:
            raise KeyError(f"{name!r}: no Hugging Face DeepSeek-V3 counterpart")
        return [f"model.layers.{config.num_layers + int(mtp.group(1))}.{_MTP_OWN[mtp.group(2)]}"]
    if name == "embedding.word_embeddings.weight":
        return [EMBED]
    if name == "output_layer.weight":
        return [EMBED] if config.share_embeddings_and_output_weights else [LM_HEAD]
    if name == "decoder.final_layernorm.weight":
        return [FINAL_NORM]
    m = _LAYER.match(name)
    if not m:
        raise KeyError(f"{name!r}: no Hugging Face Llama counterpart")
    layer, suffix = m.group(1), m.group(2)
    moe = _moe_suffix(suffix)
    if moe is not None and hf_arch(config) == "gpt_oss":
        return gpt_oss_hf_names(moe, int(layer))
    if moe is not None:
        layout = expert_layout or default_expert_layout()
        return moe_hf_names(moe, hf_arch(config), int(layer), config, layout)
    pre = f"model.layers.{layer}."
    if suffix in _LAYER_DIRECT:
        return [pre + _LAYER_DIRECT[suffix]]
    if suffix == SINKS_SUFFIX:
        return [pre + SINKS_HF]
    if config.multi_latent_attention and suffix in _MLA:
        return [pre + _MLA[suffix]]
    kind = suffix.rsplit(".", 1)[-1]
    if suffix.startswith("self_attention.linear_qkv."):
        return [f"{pre}self_attn.{p}_proj.{kind}" for p in "qkv"]
    if suffix.startswith("mlp.linear_fc1."):
        return [f"{pre}mlp.{p}_proj.{kind}" for p in ("gate", "up")]
    raise KeyError(f"{name!r}: no Hugging Face Llama counterpart")


def read_shard(
    name: str,
    src: TensorSource,
    config: TransformerConfig,
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    vocab_size: int,
    padded_vocab_size: int,
    ep_rank: int = 0,
    ep_size: int = 1,
    etp_rank: int | None = None,
    etp_size: int | None = None,
) -> torch.Tensor:
    """Tp rank `tp_rank`'s part of our parameter `name` (global layer index), read from HF.

    MoE parameters (`mlp.router`, `mlp.experts`, `mlp.shared_experts`): see `moe_map`;
    experts take (ep_rank, etp_rank)'s part (etp defaults to tp).

    Shapes (d = kv_channels, qpg = nq/ng, f = ffn_hidden_size, t = tp_size):
    vocab `[Vp/t, h]` (rows past V are zeros), qkv `[(nq+2ng) d / t, h]`,
    fc1 `[2f/t, h]` = cat([gate_r, up_r]), proj `[h, nq d / t]`, fc2 `[h, f/t]`, norms full.
    """
    name = as_decoder_name(name, config)
    m, mtp = _LAYER.match(name), _MTP.match(name)
    suffix = m.group(2) if m else (mtp.group(2) if mtp else name)
    moe = _moe_suffix(suffix) if m else None
    if m is not None and moe is not None and hf_arch(config) == "gpt_oss":
        return read_gpt_oss_moe_shard(
            moe,
            int(m.group(1)),
            src,
            config,
            ep_rank=ep_rank,
            ep_size=ep_size,
            etp_rank=tp_rank if etp_rank is None else etp_rank,
            etp_size=tp_size if etp_size is None else etp_size,
        )
    if m is not None and moe is not None:
        return read_moe_shard(
            moe,
            int(m.group(1)),
            src,
            config,
            tp_rank=tp_rank,
            tp_size=tp_size,
            ep_rank=ep_rank,
            ep_size=ep_size,
            etp_rank=tp_rank if etp_rank is None else etp_rank,
            etp_size=tp_size if etp_size is None else etp_size,
        )
    hf = hf_names_for(name, config)
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        start, stop = _part(padded_vocab_size, tp_rank, tp_size, "padded_vocab_size")
        rows = src.read(hf[0], 0, min(start, vocab_size), min(stop, vocab_size))
        if rows.size(0) < stop - start:
            pad = rows.new_zeros((stop - start - rows.size(0), *rows.shape[1:]))
            rows = torch.cat([rows, pad], 0)
        return rows
    if suffix.startswith("self_attention.linear_qkv."):
        d, ng = config.kv_channels, config.num_query_groups
        assert d is not None and ng is not None, "TransformerConfig.__post_init__ fills them in"
        qpg = config.num_attention_heads // ng
        g0, g1 = _part(ng, tp_rank, tp_size, "num_query_groups")
        n = g1 - g0
        q = src.read(hf[0], 0, g0 * qpg * d, g1 * qpg * d)
        k = src.read(hf[1], 0, g0 * d, g1 * d)
        v = src.read(hf[2], 0, g0 * d, g1 * d)
        rest = q.shape[1:]
        fused = torch.cat(
            [q.reshape(n, qpg * d, *rest), k.reshape(n, d, *rest), v.reshape(n, d, *rest)], 1
        )
        return fused.reshape(n * (qpg + 2) * d, *rest)
    if suffix == SINKS_SUFFIX:  # one per query head: this rank's heads
        start, stop = _part(config.num_attention_heads, tp_rank, tp_size, "num_attention_heads")
        return src.read(hf[0], 0, start, stop)
    if suffix.startswith("mlp.linear_fc1."):
        ffn = config.ffn_hidden_size
        assert ffn is not None, "TransformerConfig.__post_init__ fills it in"
        start, stop = _part(ffn, tp_rank, tp_size, "ffn_hidden_size")
        return torch.cat([src.read(h, 0, start, stop) for h in hf], 0)
    if config.multi_latent_attention and suffix in _MLA_DUPLICATED:
        return src.read(hf[0])  # every tp rank holds it whole
    if suffix.endswith("proj.weight") and (suffix in _MLA or suffix == "eh_proj.weight"):
        out_rows = config.hidden_size if suffix == "eh_proj.weight" else _mla_rows(suffix, config)
        start, stop = _part(out_rows, tp_rank, tp_size, f"{hf[0]} rows")
        return src.read(hf[0], 0, start, stop)
    if suffix in _ROW_PARALLEL:
        if tp_size == 1:
            return src.read(hf[0])
        cols = config.query_projection_size if "linear_proj" in suffix else config.ffn_hidden_size
        if config.multi_latent_attention and "linear_proj" in suffix:
            cols = config.num_attention_heads * config.v_head_dim
        assert cols is not None, "TransformerConfig.__post_init__ fills ffn_hidden_size in"
        start, stop = _part(cols, tp_rank, tp_size, f"{hf[0]} columns")
        return src.read(hf[0], 1, start, stop)
    return norm_weight_from_hf(name, src.read(hf[0]), config)


def full_to_hf(
    full: dict[str, torch.Tensor],
    config: TransformerConfig,
    vocab_size: int,
    *,
    expert_layout: str | None = None,
) -> dict[str, torch.Tensor]:
    """Full (tp=ep=1) tensors with global layer names -> HF tensors (padding rows dropped).

    Takes any subset (e.g. one pipeline stage's). Tied: `output_layer.weight`, if present,
    gives `lm_head.weight` too, as `LlamaForCausalLM.state_dict()` lists it. MoE experts
    are written in `expert_layout` ("fused" | "per_expert"; None: the installed
    transformers' in-memory layout, see `moe_map`).
    """
    layout = expert_layout or default_expert_layout()
    out: dict[str, torch.Tensor] = {}
    d, ng = config.kv_channels, config.num_query_groups
    assert d is not None and ng is not None, "TransformerConfig.__post_init__ fills them in"
    qpg = config.num_attention_heads // ng
    for name, t in full.items():
        name = as_decoder_name(name, config)
        if _MTP.match(name):
            out[hf_names_for(name, config)[0]] = norm_weight_to_hf(name, t, config)
            continue
        if name == "embedding.word_embeddings.weight":
            out[EMBED] = t[:vocab_size]
            if config.share_embeddings_and_output_weights:
                out[LM_HEAD] = out[EMBED]
            continue
        if name == "output_layer.weight":
            out[LM_HEAD] = t[:vocab_size]
            continue
        m = _LAYER.match(name)
        suffix = m.group(2) if m else name
        moe = _moe_suffix(suffix) if m else None
        if m is not None and moe is not None and hf_arch(config) == "gpt_oss":
            out.update(gpt_oss_moe_full_to_hf(moe, int(m.group(1)), t))
            continue
        if m is not None and moe is not None:
            out.update(moe_full_to_hf(moe, int(m.group(1)), t, config, layout))
            continue
        hf = hf_names_for(name, config)
        if suffix.startswith("self_attention.linear_qkv."):
            rest = t.shape[1:]
            grouped = t.reshape(ng, (qpg + 2) * d, *rest)
            q, k, v = torch.split(grouped, [qpg * d, d, d], dim=1)
            for key, part in zip(hf, (q, k, v)):
                out[key] = part.reshape(-1, *rest)
        elif suffix.startswith("mlp.linear_fc1."):
            gate, up = torch.chunk(t, 2, dim=0)
            out[hf[0]], out[hf[1]] = gate, up
        else:
            out[hf[0]] = norm_weight_to_hf(name, t, config)
    _mtp_copies(out, config)
    return {k: v.contiguous() for k, v in out.items()}


def _mtp_copies(out: dict[str, torch.Tensor], config: TransformerConfig) -> None:
    """DeepSeek's MTP layers carry the embedding and the output layer (where this part of
    the model has them: the MTP stage does)."""
    for k in range(config.mtp_num_layers or 0):
        pre = f"model.layers.{config.num_layers + k}."
        if pre + "eh_proj.weight" not in out:
            continue
        if EMBED in out:
            out[pre + "embed_tokens.weight"] = out[EMBED]
        if LM_HEAD in out:
            out[pre + "shared_head.head.weight"] = out[LM_HEAD]


def chunk_param_names(
    config: TransformerConfig,
    *,
    pre_process: bool,
    post_process: bool,
    layer_offset: int,
    num_layers: int,
    mtp: bool | None = None,
    final_norm: bool | None = None,
) -> list[str]:
    """Local state-dict names of one GPTModel chunk of a Llama / Mixtral / Qwen2-MoE config.

    (Checked against `GPTModel.state_dict()` in the tests; used where no model is built,
    e.g. by the converter CLI.) `layer_offset` picks the chunk's MoE layers. `mtp` /
    `final_norm`: the chunk holds the MTP layers / the decoder's final norm (None: the last
    stage does, as without a standalone MTP stage; see `TransformerConfig.mtp_on`).
    """
    per_layer, dense, moe = _layer_suffixes(config)
    if mtp is None:
        mtp = bool(config.mtp_num_layers) and post_process
    final_norm = post_process if final_norm is None else final_norm
    names = ["embedding.word_embeddings.weight"] if pre_process or mtp else []
    for i in range(num_layers):
        mlp = moe if config.is_moe_layer(layer_offset + i + 1) else dense
        names += [f"decoder.layers.{i}.{s}" for s in per_layer + mlp]
    if final_norm:
        names.append("decoder.final_layernorm.weight")
    if mtp:  # GPTModel's order: the decoder (with its final norm), MTP, the output layer
        mlp = moe if config.is_moe_layer(config.num_layers + 1) else dense
        for k in range(config.mtp_num_layers or 0):
            pre = f"mtp.layers.{k}."
            names += [pre + "enorm.weight", pre + "hnorm.weight", pre + "eh_proj.weight"]
            names += [f"{pre}mtp_model_layer.{s}" for s in per_layer + mlp]
            names.append(pre + "final_layernorm.weight")
    if post_process:
        tied_here = (pre_process or mtp) and config.share_embeddings_and_output_weights
        if not tied_here:
            names.append("output_layer.weight")
    return names


def _layer_suffixes(config: TransformerConfig) -> tuple[list[str], list[str], list[str]]:
    """(attention and norms, dense MLP, MoE MLP) suffixes of one decoder layer."""
    bias = config.add_bias_linear
    per_layer = ["input_layernorm.weight"]
    if config.multi_latent_attention:
        per_layer += [f"self_attention.{n}.weight" for n in _mla_modules(config)]
    else:
        per_layer.append("self_attention.linear_qkv.weight")
        if bias or config.add_qkv_bias:
            per_layer.append("self_attention.linear_qkv.bias")
        if config.softmax_type == "learnable":
            per_layer.append(SINKS_SUFFIX)
    per_layer.append("self_attention.linear_proj.weight")
    if bias:
        per_layer.append("self_attention.linear_proj.bias")
    if config.qk_layernorm and not config.multi_latent_attention:
        per_layer += ["self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"]
    per_layer.append("pre_mlp_layernorm.weight")
    dense = ["mlp.linear_fc1.weight"] + (["mlp.linear_fc1.bias"] if bias else [])
    dense += ["mlp.linear_fc2.weight"] + (["mlp.linear_fc2.bias"] if bias else [])
    moe = ["mlp." + s for s in moe_param_suffixes(config)] if config.is_moe else []
    return per_layer, dense, moe


def _mla_modules(config: TransformerConfig) -> list[str]:
    """MLASelfAttention's weights in construction order (without linear_proj)."""
    q = ["linear_q_proj"]
    if config.q_lora_rank is not None:
        q = ["linear_q_down_proj", "linear_q_up_proj", "q_layernorm"]
    kv = ["linear_kv_down_proj", "linear_kv_up_proj", "kv_layernorm"]
    return q + kv


def hf_keys_expected(config: TransformerConfig, expert_layout: str | None = None) -> list[str]:
    """Every tensor a HF checkpoint of `config` holds (tied: no lm_head)."""
    names = chunk_param_names(
        config, pre_process=True, post_process=True, layer_offset=0, num_layers=config.num_layers
    )
    keys: list[str] = []
    for n in names:
        keys += hf_names_for(n, config, expert_layout)
    return list(dict.fromkeys(keys))
