"""Activation bytes saved for backward, per micro-batch, for Pentatron's modules.

Each term is a tensor that autograd keeps (derived from the code and checked against
`measure`'s saved-tensor hooks). Notation: s sequence (divided by cp), b micro-batch,
h hidden, t tp, s' = s/t with sequence parallelism else s (norm / residual region),
e = bytes of the activation dtype (the params dtype), nq/ng heads/groups, d head dim,
F ffn, F1 = 2F with SwiGLU else F, V padded vocabulary.

Per transformer layer (no recompute):
- each RMSNorm (2 per layer): its input in its own dtype `e s'bh` and the fp32 rstd `4 s'b`
  (tp-layers' norms are one autograd function each, as Megatron's fused norm kernels),
  its output (kept by the next linear) `e s'bh`; LayerNorm: also the fp32 mean `4 s'b`;
- attention: the fused QKV output `e sb(nq+2ng)d/t` (RoPE and SDPA keep views of it);
  RoPE's rotated q and k `e sb(nq+ng)d/t` (+ in 16-bit the cos/sin casts `4 e s b_pos r`);
  SDPA takes GQA's grouped k and v as they are, except for heads over 256 dims and fp32
  on CUDA (`pentatron.models.sdpa.takes_grouped_kv`; `MemoryPlan.device`), where the
  repeated k and v `2 e sb nq d/t` are kept instead; SDPA's output `e sb nq d/t`
  (also the input of linear_proj) and its fp32 log-sum-exp `4 b nq/t s`. SDPA is a flash kernel: no
  `s x s` matrix is stored, which is why Korthikanti's `5as/h` term is absent;
- MLP: fc1 output `e sb F1/t`; the activation's output (fc2's input) `e sb F/t`; SwiGLU
  without bias_activation_fusion also silu(gate) `e sb F/t`;
- dropout (p > 0): a mask per dropped element (not in the measured matrix).
Selective recompute checkpoints core attention: its inputs stay (q, k, QKV output), the
log-sum-exp and the GQA repeats go. Full recompute keeps only each checkpoint's input
`e s'bh` (uniform: one per group of recompute_num_layers; block: the first k layers, the
rest as without recompute) plus the chunk's RoPE tables.
Per chunk: RoPE cos/sin `2 x 4 s b_pos r` (b_pos = b where position ids come with the batch,
the first stage; else 1) in fp32 models; embedding: the token batch `4 x 8 bs` (int64
tokens/labels/mask/positions share one storage), with tp the local ids `8 bs` and the
foreign mask `bs` instead, plus the batch again with learned positions (their lookup keeps
the position ids, a view of it); output: final norm, fp32 softmax of the logits
`4 s b V/t`, labels `8 bs`, the foreign-target mask `bs`, the loss mask `4 bs` and the
token count (not with per-token loss). Multi-latent attention: `_mla_terms`; the MTP
depths on the last chunk: `_mtp_terms` (that stage then gets the position ids too).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from pentatron.models.attention_variants import MIN_WINDOW_BLOCKS, SINK_PAD
from pentatron.models.sdpa import takes_grouped_kv
from pentatron.pipeline import rank_schedule

from .plan import MemoryPlan
from .static import chunk_layers, chunk_parameters, is_first_chunk, is_last_chunk


@dataclass
class ActivationTerms:
    """Bytes per module for one micro-batch of one chunk."""

    embedding: int = 0
    attention_norm: int = 0
    attention: int = 0
    core_attention: int = 0
    mlp_norm: int = 0
    mlp: int = 0
    moe_dispatch: int = 0
    recompute_inputs: int = 0
    rope: int = 0
    output_layer: int = 0
    final_norm: int = 0
    mtp: int = 0  # the multi-token-prediction depths (last chunk)

    @property
    def total(self) -> int:
        return sum(vars(self).values())

    def add(self, other: ActivationTerms) -> None:
        for k in vars(self):
            setattr(self, k, getattr(self, k) + getattr(other, k))


def _seq(plan: MemoryPlan) -> int:
    return plan.seq_length // plan.cp


def _norm_bytes(plan: MemoryPlan, s_: int, b: int, e: int) -> int:
    """One norm over `[s', b, h]`: its input and output `2e s'bh`, and its fp32 rstd (and
    LayerNorm's mean) `4 s'b` each."""
    stats = 1 if plan.config.normalization == "RMSNorm" else 2
    return 2 * e * s_ * b * plan.config.hidden_size + 4 * stats * s_ * b


def _layer_terms(plan: MemoryPlan, layer: int, first: bool) -> ActivationTerms:
    """Transformer layer `layer` (global, 1-based; past num_layers: an MTP layer); `first`:
    position ids come with the batch (see _pos_batch)."""
    c, t, b, e = plan.config, plan.tp, plan.micro_batch_size, plan.param_bytes
    s = _seq(plan)
    s_ = s // t if c.sequence_parallel else s
    d, nq, ng = c.kv_channels, c.num_attention_heads // t, c.num_query_groups // t
    sb = s * b
    out = ActivationTerms()
    out.attention_norm = out.mlp_norm = _norm_bytes(plan, s_, b, e)
    is_moe = c.is_moe and c.is_moe_layer(layer)
    window = c.window_size[0] if c.is_window_attention_layer(layer) else None  # type: ignore[index]
    variants = c.softmax_type != "vanilla" or window is not None
    if c.multi_latent_attention:
        att, core = _mla_terms(plan, s, s_, b, e)
    elif variants and c.recompute_granularity != "selective" and plan.cp == 1:
        att, core = _variant_attention_terms(plan, sb, b, e, nq, ng, d, window)
    elif variants and c.recompute_granularity != "selective" and c.cp_comm_type == "a2a":
        # SDPA over the whole sequence for nq/cp heads; the two int64 orderings `16 s`
        cp = plan.cp
        att, core = _variant_attention_terms(plan, sb * cp, b, e, nq // cp, ng // cp, d, window)
        core += 16 * s * cp
    else:
        att, core = _attention_terms(plan, sb, b, e, nq, ng, d)
    if c.position_embedding_type in ("rope", "yarn") and e != 4 and not _up_proj_recomputed(c):
        # cos/sin cast for q and for k; FSDP2 casts a unit's float inputs to the compute
        # dtype once, cos and sin included, so the layer's own casts are no-ops
        casts = 2 if plan.use_torch_fsdp2 else 4
        att += casts * e * s * _pos_batch(plan, first) * c.rotary_dim
    out.attention, out.core_attention = att, core
    ffn = c.moe_ffn_size if is_moe else c.ffn_hidden_size
    f1 = ffn * (2 if c.gated_linear_unit else 1)
    mlp = e * sb * f1 // t + e * sb * ffn // t * _act_copies(c)
    if is_moe:
        mlp, out.moe_dispatch, correction = _moe_terms(plan, s_, b, e)
        out.mlp_norm += correction
    out.mlp = mlp
    return out


def _act_copies(c) -> int:
    """`[.., F]` tensors the activation leaves for backward (pentatron.models.activations):
    fc2's input; through plain autograd (SwiGLU without bias_activation_fusion, or any
    clamp / offset) also silu(gate), or quick-GeGLU's sigmoid(1.702 gate) and its product
    with the gate; a clamp's clamped gate; a clamp's or an offset's new `up`."""
    if not c.gated_linear_unit:
        return 1
    clamp = c.activation_func_clamp_value is not None
    plain = not clamp and c.glu_linear_offset == 0.0
    if plain and c.activation == "swiglu" and c.bias_activation_fusion:
        return 1
    act = 2 if c.activation == "quick_geglu" else 1
    return 1 + act + int(clamp) + int(not plain)


def _grouped_kv(plan: MemoryPlan, heads_per_group: int, d: int) -> bool:
    """Does SDPA get GQA's grouped k/v as they are (no mask: the app never passes one)?"""
    return takes_grouped_kv(
        heads_per_group, False, d, dtype=plan.config.params_dtype, device_type=plan.device
    )


def _variant_attention_terms(plan, sb, b, e, nq, ng, d, window) -> tuple[int, int]:
    """(QKV/RoPE bytes, core-attention bytes) with gpt-oss's sinks and / or a window
    (pentatron.models.attention_variants; `window`: keys back on this layer, or None).
    Every such call passes SDPA a mask, so GQA's k and v are repeated to nq heads:
    - a window alone over few blocks (< MIN_WINDOW_BLOCKS of left + 1): the usual terms with
      the repeats, plus the mask SDPA converts to the params dtype `e s^2`;
    - else SDPA runs on new tensors, and the QKV output and RoPE's copies are not kept:
      over B' = b (whole) or b nb (blockwise: nb blocks of R = left + 1 queries, K = 2 left
      + 1 keys each; else R = K = s) with sinks D = d + 8 head dims and K + 1 keys: q and
      the output `2 e B' nq R D`, k and v `2 e B' nq K D`, the mask `e (B') R K`, the fp32
      log-sum-exp `4 B' nq R` (CUDA's memory-efficient kernel, which a mask takes: rows
      padded to 32), and linear_proj's own copy of the output `e sb nq d`.
    Measured on the CPU; the CUDA kernel's terms are derived."""
    c, s = plan.config, sb // b
    sinks = c.softmax_type != "vanilla"
    blockwise = window is not None and -(-s // (window + 1)) >= MIN_WINDOW_BLOCKS
    if not sinks and not blockwise:
        att, core = _attention_terms(plan, sb, b, e, nq, ng, d, masked=True)
        padded_lse = 0 if plan.device == "cpu" else 4 * b * nq * (-(-s // 32) * 32 - s)
        return att, core + e * s * s + padded_lse
    if blockwise:
        rows, nb = window + 1, -(-s // (window + 1))
        calls, keys = b * nb, 2 * window + 1
    else:
        rows, calls, keys = s, b, s
    dd, keys = (d + SINK_PAD, keys + 1) if sinks else (d, keys)
    mask = e * (calls if blockwise else 1) * rows * keys
    lse_rows = rows if plan.device == "cpu" else -(-rows // 32) * 32
    core = 2 * e * calls * nq * rows * dd + 2 * e * calls * nq * keys * dd + mask
    return 0, core + 4 * calls * nq * lse_rows + e * sb * nq * d


def _attention_terms(plan, sb, b, e, nq, ng, d, masked: bool = False) -> tuple[int, int]:
    """(QKV/RoPE/SDPA-input bytes, core-attention bytes). RoPE's multiplies keep only
    cos/sin; SDPA keeps q, k, v and its output. k and v are views of the QKV output
    unless GQA repeats them (heads over 256 dims, fp32 on CUDA; then the repeats are kept
    instead); q is a copy with RoPE or those repeats. Selective recompute keeps the
    checkpoint's inputs q, k, v (before any repeat), with cp > 1 too: every cp kind runs
    inside the checkpoint, so the ring's output and lse, or a2a's exchanged tensors, are
    not kept (measured exact at cp2 p2p, all_gather and a2a). Otherwise with cp > 1 see
    `_cp_attention_terms`."""
    c = plan.config
    selective = c.recompute_granularity == "selective"
    if plan.cp > 1 and not selective:
        return _cp_attention_terms(plan, sb, b, e, nq, ng, d)
    rope = c.position_embedding_type in ("rope", "yarn")
    # SDPA reads grouped k/v itself; the model repeats them only for heads over 256 dims,
    # fp32 on CUDA (or with an attention mask, which the app never passes): models.sdpa.
    gqa = nq != ng and (masked or not _grouped_kv(plan, nq // ng, d))
    att = e * sb * nq * d if (rope or gqa) else 0
    if selective or not gqa:
        att += e * sb * (nq + 2 * ng) * d + (e * sb * ng * d if rope else 0)
    else:
        att += 2 * e * sb * nq * d
    core = e * sb * nq * d + (0 if selective else 4 * b * nq * sb // b)
    return att, core


def _mla_terms(plan: MemoryPlan, s: int, s_: int, b: int, e: int) -> tuple[int, int]:
    """(latent bytes, core-attention bytes) of one multi-latent attention layer (n = heads
    per tp rank, d_q = qk_head_dim + qk_pos_emb_head_dim, r_q / r_kv the latent ranks):
    - the q latent, the (duplicated) down-projection's output `e s'b r_q`, this rank's
      tokens under SP (kept by its norm, or without the norms by the up-projection); with
      the latent norms also their fp32 rstd `4 s'b` and the normed latent `e s'b r_q` (the
      up-projection's input);
    - the kv down-projection's output `e s'b (r_kv + d_pe)` (the latent and k_pe are views
      of it; the norm or the up-projection keeps the latent); with the norm its rstd and
      output `e s'b r_kv`;
    - RoPE keeps only its cos / sin (and their 16-bit casts, added by the caller);
    - core attention on CUDA (the memory-efficient kernel, as flash needs one head dim for
      q, k and v): q and k `2 e sb n d_q` (the concatenations), v as a view of the kv
      up-projection `e sb n (d_qk + d_v)`, the output `e sb n d_v` and the fp32
      log-sum-exp `4 b n ceil(s/32) 32`; on the CPU SDPA's math kernel: fp32 copies of
      q (scaled) and k^T `2 x 4 sb n d_q`, the fp32 probabilities `4 b n s^2` and v (fp32:
      the up-projection's view; 16-bit: an fp32 copy `4 sb n d_v`). Selective recompute
      (core_attn) keeps the checkpoint's q, k and v instead;
    - linear_proj's input `e sb n d_v`."""
    c, t = plan.config, plan.tp
    n, d_q = c.num_attention_heads // t, c.qk_head_dim + c.qk_pos_emb_head_dim
    sb, sb_, norms = s * b, s_ * b, c.qk_layernorm
    att = 0
    if c.q_lora_rank is not None:
        att += e * sb_ * c.q_lora_rank + ((4 + e * c.q_lora_rank) * sb_ if norms else 0)
    r_kv = c.kv_lora_rank
    att += e * sb_ * (r_kv + c.qk_pos_emb_head_dim)
    att += (4 + e * r_kv) * sb_ if norms else 0
    kv_up = e * sb * n * (c.qk_head_dim + c.v_head_dim)  # v is a view of it
    if _up_proj_recomputed(c):
        # the checkpoint's q, k, v are views of the discarded output: freed; it keeps its
        # inputs (the latents, counted above; under SP the gathered k_pe `e s b d_pe`)
        gathered_k_pe = e * sb * c.qk_pos_emb_head_dim if c.sequence_parallel else 0
        return att + gathered_k_pe, e * sb * n * c.v_head_dim
    if c.recompute_granularity == "selective":
        core = 2 * e * sb * n * d_q + kv_up
    elif plan.cp > 1:
        core = _mla_cp_core(plan, sb, b, e, n, d_q)
    elif plan.device == "cpu":
        core = (
            2 * 4 * sb * n * d_q
            + 4 * b * n * s * s
            + (kv_up if e == 4 else 4 * sb * n * c.v_head_dim)
        )
    else:
        core = (
            2 * e * sb * n * d_q
            + kv_up
            + e * sb * n * c.v_head_dim
            + 4 * b * n * (-(-s // 32) * 32)
        )
    return att, core + e * sb * n * c.v_head_dim


def _mla_cp_core(plan: MemoryPlan, sb: int, b: int, e: int, n: int, d_q: int) -> int:
    """MLA's core attention with cp > 1 (linear_proj's input added by the caller): the
    attention pads v to q's head dim (the cp kinds move K and V as one block), a new
    tensor, so the kv up-projection is not kept; then as `_cp_attention_terms` with n
    heads of d_q dims and no grouping: p2p / all_gather keep q, k, the padded v, their
    output `e sb n d_q` and lse; a2a its exchanged q, k, v, output, lse and orderings."""
    c, cp = plan.config, plan.cp
    lse = 4 * n * sb
    if c.cp_comm_type == "a2a":
        return 4 * e * sb * n * d_q + lse + 16 * sb // b * cp
    return 4 * e * sb * n * d_q + lse


def _up_proj_recomputed(c) -> bool:
    """MLA's up-projections and RoPE in an output-discarding checkpoint (selective
    "mla_up_proj", with "core_attn": the plan refuses it alone)."""
    return (
        c.multi_latent_attention
        and c.recompute_granularity == "selective"
        and "mla_up_proj" in (c.recompute_modules or ())
    )


def _mtp_terms(plan: MemoryPlan, s: int, s_: int, b: int, e: int, part: str = "all") -> int:
    """Saved bytes of the MTP depths (last chunk), per depth k:
    - the embedding of the rolled ids: the ids `8 bs` (tp > 1: with the foreign mask `bs`;
      learned positions: the rolled position ids `8 bs`), its output `e s'bh` (kept by
      enorm) and enorm's rstd; hnorm's rstd (its input, h_{k-1}, is kept by an output
      layer already); eh_proj's input, the concatenation `e s'b 2h`;
    - the layer (built like the last decoder layer); its input is eh_proj's output
      gathered over tp: under SP the first norm keeps a view of the whole `[s, b, h]`;
    - its final norm; the output layer as the main one's (fp32 softmax `4 sb V/t`, labels
      `8 sb`, foreign mask `sb`), the rolled loss mask `4 bs` and the token count `4`;
    - full recompute: a depth is one checkpoint, keeping its embedding output and its
      output `2 e s'bh` besides the ids and the output layer's terms.
    Once: the attached total `4` (with per-token loss also the unrolled token count `4`,
    which every depth's term is multiplied by).
    `part` splits them for a standalone MTP stage: "layers" (that stage: all but the output
    layers, less the last depth's output, which leaves in the message and nothing there
    keeps), "loss" (the loss's stage: the output layers and totals, and the received h_0
    and depth outputs `(1 + D) e s'bh`, one copy the output layers keep)."""
    c, t, h = plan.config, plan.tp, plan.config.hidden_size
    depths = c.mtp_num_layers or 0
    sb, sb_ = s * b, s_ * b
    ids = 8 * sb + (sb if t > 1 else 0)
    if c.position_embedding_type == "learned_absolute":
        ids += 8 * sb
    output = 4 * sb * plan.padded_vocab_size // t + (8 + 1 + 4) * sb + 4
    if c.recompute_granularity == "full":
        per_depth = ids + 2 * e * sb_ * h
    else:
        rstd = 4 if c.normalization == "RMSNorm" else 8
        per_depth = ids + e * sb_ * h + 2 * rstd * sb_ + 2 * e * sb_ * h
        layer = _layer_terms(plan, c.num_layers + 1, True)
        per_depth += layer.total + (e * (sb - sb_) * h if c.sequence_parallel else 0)
        per_depth += _norm_bytes(plan, s_, b, e)
    totals = 4 + (4 if c.calculate_per_token_loss else 0)
    if part == "layers":
        return depths * per_depth - e * sb_ * h
    if part == "loss":
        return depths * output + totals + (1 + depths) * e * sb_ * h
    return depths * (per_depth + output) + totals


def _cp_attention_terms(plan, sb, b, e, nq, ng, d) -> tuple[int, int]:
    """Context-parallel attention over this rank's s/cp tokens (sb = s/cp * b):
    - p2p (ring) and all_gather: the autograd function keeps q, local k, v (as without
      cp: the QKV output and RoPE's q, k copies), its output as it returns it `e sb nq d`
      (models >= 0.7.1; the fp32 merge before) and fp32 log-sum-exp `4 b nq s/cp`;
      linear_proj keeps its own contiguous copy of the output `e sb nq d`. K/V of other
      ranks are re-received in backward, not kept;
    - a2a (Ulysses): q, k, v are exchanged to all s and nq/cp heads and re-ordered, so
      RoPE's outputs and the QKV output are not kept; SDPA keeps q, k, v (with GQA k, v
      at ng/cp heads, repeated to nq/cp for heads over 256 dims and fp32 on CUDA), its
      output, log-sum-exp, and the two int64 orderings `16 s`;
      linear_proj keeps the exchanged-back output `e sb nq d`;
    - a2a+p2p: the all-to-all's exchanged and re-ordered q, k, v go to the ring, which
      keeps them (`e sb (nq + 2 ng) d`: a times the tokens at 1/a of the heads), its
      output and lse as p2p's; nothing keeps the QKV output or RoPE's copies, as a2a;
      linear_proj keeps the exchanged-back output.
    Bytes of [s, nq/cp] tensors equal those of [s/cp, nq]. Selective recompute: see
    `_attention_terms`."""
    c, cp = plan.config, plan.cp
    rope = c.position_embedding_type in ("rope", "yarn")
    lse = 4 * nq * sb
    if c.cp_comm_type == "a2a":
        kv = ng if _grouped_kv(plan, nq // ng, d) else nq  # heads of k and v
        core = e * sb * (2 * nq + 2 * kv) * d + lse + 16 * sb // b * cp  # q, k, v, out
        return 0, core + e * sb * nq * d
    if c.cp_comm_type == "a2a+p2p":  # the ring's q, k, v, out: exchanged copies
        return 0, e * sb * (nq + 2 * ng) * d + 2 * e * sb * nq * d + lse
    att = e * sb * (nq + 2 * ng) * d + (e * sb * (nq + ng) * d if rope else 0)
    return att, 2 * e * sb * nq * d + lse


def _routed_rows(plan: MemoryPlan, tokens: int) -> tuple[int, int]:
    """(rows one rank's dispatcher permutes, rows its experts see) for `tokens` local
    tokens. Without a capacity factor a token goes to exactly k experts, so T*k rows leave
    a rank and, summed over the ep group, T*k*ep arrive: per rank T*k on average (the split
    is data-dependent). allgather permutes the etp*ep group's tokens for its E/ep experts:
    etp*T*k on average. With a capacity factor the bound E*C (C = ceil(T*k/E * cf)) is
    used instead: padded inputs fill it, dropping only stays under it."""
    c = plan.config
    k, n_exp = c.moe_router_topk, c.num_moe_experts
    routed = tokens * k
    if c.moe_expert_capacity_factor is not None:
        cap = -(-tokens * k * c.moe_expert_capacity_factor // n_exp)
        routed = int(
            min(routed, n_exp * cap) if not c.moe_pad_expert_input_to_capacity else n_exp * cap
        )
    expert_rows = routed * plan.etp
    if c.moe_token_dispatcher_type == "allgather":
        return expert_rows, expert_rows
    return routed, expert_rows


def _moe_terms(plan: MemoryPlan, s_: int, b: int, e: int) -> tuple[int, int, int]:
    """(expert MLP bytes, router + dispatcher bytes, norm-output correction) of one MoE
    layer over T = s'b local tokens, N permuted rows, M expert rows (`_routed_rows`):
    - router: top-k indices `8 Tk`, softmax of the top-k `4 Tk` (its gating GEMM, in the
      router dtype as Megatron, keeps only the norm output already counted);
    - dispatcher: permute's indices `8 N`; unpermute's per-row weights `4 N`, its input and
      the weighted rows `2 e N h`, and the (local-expert slice of the) probs `p E'R` (p: the
      bytes of --moe-router-dtype, else of the params) and
      routing map `E'R` with R rows routed (alltoall: T, E' = E; allgather: etp*ep*T,
      E' = E/ep);
    - experts: their input `e M h`, fc1 output `e M F1/etp`, activation `e M F/etp`
      (SwiGLU without bias_activation_fusion: silu(gate) too, `2 e M F/etp`);
    - shared experts: a dense MLP of width F_s over tp; gated (Qwen2-MoE), the product
      `out * sigmoid(x g)` also keeps the shared output `e Th` and the gate `e T` (derived
      from the autograd ops, not measured: the app has no flag for the gate)."""
    c, h = plan.config, plan.config.hidden_size
    k, n_exp, t = c.moe_router_topk, c.num_moe_experts, s_ * b
    rows, m = _routed_rows(plan, t)
    glu = 2 if c.gated_linear_unit else 1
    f = c.moe_ffn_size // plan.etp
    mlp = e * m * (h + f * glu + f * _act_copies(c))
    shared = c.moe_shared_expert_intermediate_size
    if shared:
        s_full = plan.seq_length // plan.cp
        mlp += e * s_full * b * (shared // plan.tp) * (glu + _act_copies(c))
        if c.moe_shared_expert_gate:  # out * sigmoid(x g): the product keeps out and the gate
            mlp += e * t * h + e * t
    router = 12 * t * k
    p = {"fp32": 4, "fp64": 8}.get(c.moe_router_dtype or "", e)
    if c.moe_token_dispatcher_type == "allgather":
        r, n_local = plan.etp * plan.ep * t, n_exp // plan.ep
    else:
        r, n_local = t, n_exp
    dispatch = 12 * rows + 2 * e * rows * h + (p + 1) * n_local * r
    return mlp, router + dispatch, 0


def _pos_batch(plan: MemoryPlan, first: bool) -> int:
    return plan.micro_batch_size if first else 1


def chunk_activations(plan: MemoryPlan, pp_rank: int, vp: int) -> ActivationTerms:
    """Saved bytes of one micro-batch's forward through chunk `vp` of stage `pp_rank`."""
    c, t, b, e = plan.config, plan.tp, plan.micro_batch_size, plan.param_bytes
    s = _seq(plan)
    s_ = s // t if c.sequence_parallel else s
    first, last = is_first_chunk(plan, pp_rank, vp), is_last_chunk(plan, pp_rank, vp)
    layers = list(chunk_layers(plan, pp_rank, vp))
    out = ActivationTerms()
    mtp = c.mtp_on(pp_rank, vp, last)  # the MTP stage gets the position ids too
    if (
        c.position_embedding_type in ("rope", "yarn")
        and (layers or mtp)  # (a chunk without layers computes no tables)
        and (e == 4 or c.recompute_granularity == "full" or _up_proj_recomputed(c))
    ):  # the fp32 tables themselves are kept (an mla_up_proj checkpoint's inputs)
        out.rope = 2 * 4 * s * _pos_batch(plan, first or mtp) * c.rotary_dim
    if first:
        # tp = 1: the batch's int64 [4, b, s] storage; tp > 1: local ids and foreign mask,
        # and the batch storage when learned positions keep their ids (a view of it);
        # cp > 1 (tp = 1): the rank's int64 slice of the tokens `8 bs`
        if t > 1:
            learned = c.position_embedding_type == "learned_absolute"
            out.embedding = (8 + 1) * b * s + (4 * 8 * b * s if learned else 0)
        else:
            out.embedding = 8 * b * s if plan.cp > 1 else 4 * 8 * b * plan.seq_length
    stored = _stored_layers(plan, len(layers))
    for i, layer in enumerate(layers):
        if i in stored:
            out.add(_layer_terms(plan, layer + 1, first or mtp))
    out.recompute_inputs = _num_checkpoints(plan, len(layers)) * e * s_ * b * c.hidden_size
    if c.final_norm_on(pp_rank, vp, last):
        out.final_norm = _norm_bytes(plan, s_, b, e)
    if last:
        # the token count the loss is divided by (not with per-token loss: the step divides)
        count = 0 if c.calculate_per_token_loss else 4
        out.output_layer = 4 * s * b * plan.padded_vocab_size // t + (8 + 1 + 4) * s * b + count
    standalone = c.mtp_standalone
    if mtp:
        out.mtp = _mtp_terms(plan, s, s_, b, e, "layers" if standalone else "all")
    elif last and standalone:
        out.mtp = _mtp_terms(plan, s, s_, b, e, "loss")
    return out


def _stored_layers(plan: MemoryPlan, n: int) -> set[int]:
    """Local layers whose activations are stored (not inside a full-recompute checkpoint)."""
    c = plan.config
    if c.recompute_granularity != "full":
        return set(range(n))
    if c.recompute_method == "block":
        return set(range(min(c.recompute_num_layers, n), n))
    return set()


def _num_checkpoints(plan: MemoryPlan, n: int) -> int:
    c = plan.config
    if c.recompute_granularity != "full" or n == 0:
        return 0
    k = c.recompute_num_layers
    return min(k, n) if c.recompute_method == "block" else -(-n // k)


def microbatches_in_flight(plan: MemoryPlan, pp_rank: int) -> float:
    """Micro-batches whose activations a stage holds at its peak, in units of a whole
    stage's micro-batch (all its chunks). 1F1B: min(p - r, m). Interleaved: the warm-up
    of (p - r - 1)*2 + (v - 1)*p chunk-forwards plus the one in steady state, capped at
    m*v, divided by v chunks per micro-batch."""
    p, m, v = plan.pp, plan.num_microbatches, plan.vpp
    if v == 1:
        return min(p - pp_rank, m)
    warmup = min((p - pp_rank - 1) * 2 + (v - 1) * p, m * v)
    return min(warmup + 1, m * v) / v


def korthikanti_per_layer(
    s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False, recompute: str | None = None
) -> float:
    """Textbook bytes per layer (Korthikanti et al. 2022, 16-bit): `sbh(34 + 5as/h)`;
    tp without sp: `sbh(10 + 24/t + 5as/(ht))`; tp+sp: `/t`; selective drops `5as/h`;
    full keeps `2sbh`."""
    if recompute == "full":
        return 2 * s * b * h
    attn = 0.0 if recompute == "selective" else 5 * a * s / h
    if sp:
        return s * b * h * (34 + attn) / t
    return s * b * h * (10 + 24 / t + attn / t)


_TE_LINEAR = re.compile(
    r"decoder\.layers\.\d+\.(self_attention\.linear_(qkv|proj)|mlp\.linear_fc[12])\.weight$"
)


def fp8_weight_copies(plan: MemoryPlan, pp_rank: int) -> int:
    """Bytes of TE's cached FP8 weight copies on stage `pp_rank`.

    Each schedule call opens a weight-cache window (`is_first_microbatch`, as Megatron
    passes it): a TE linear casts its weight to FP8 at its first micro-batch, row-wise for
    the forward GEMM plus its transpose for dgrad (Hopper), keeps that copy, and the other
    micro-batches' forwards and backwards use it: 2 bytes per weight element, once, for as
    long as the model lives. TE linears are linear_qkv and linear_fc1 (with their fused
    norms), linear_proj and linear_fc2; MoE experts, shared experts, the router,
    embeddings and the output layer stay local (not FP8)."""
    c = plan.config
    if not c.fp8:
        return 0
    n = 0
    for vp in range(plan.vpp):
        for p in chunk_parameters(plan, pp_rank, vp):
            if _TE_LINEAR.match(p.name) is not None:
                n += p.numel
    return 2 * n


@dataclass
class StageActivations:
    per_microbatch: ActivationTerms = field(default_factory=ActivationTerms)
    in_flight: float = 1.0

    @property
    def peak_bytes(self) -> int:
        return int(self.per_microbatch.total * self.in_flight)


def stage_activations(plan: MemoryPlan, pp_rank: int) -> StageActivations:
    terms = ActivationTerms()
    for vp in range(plan.vpp):
        terms.add(chunk_activations(plan, pp_rank, vp))
    from . import zero_bubble  # it builds on chunk_activations

    if zero_bubble.is_zero_bubble(plan) and terms.total:
        # the schedule's own order: the peak of forwards whose B has not run
        return StageActivations(terms, zero_bubble.peaks(plan, pp_rank)[0] / terms.total)
    if plan.vpp > 1 and terms.total:
        return StageActivations(terms, interleaved_peak(plan, pp_rank) / terms.total)
    return StageActivations(terms, microbatches_in_flight(plan, pp_rank))


def interleaved_peak(plan: MemoryPlan, pp_rank: int) -> int:
    """Saved bytes at their peak along the rank's interleaved schedule: the chunks of a
    custom or accounted split differ in size, so which chunk-forwards are in flight matters
    (with equal chunks this is microbatches_in_flight's count times a chunk)."""
    act = [chunk_activations(plan, pp_rank, vp).total for vp in range(plan.vpp)]
    live = peak = 0
    for op in rank_schedule(plan.pp, pp_rank, plan.num_microbatches, plan.vpp):
        live += act[op.chunk] if op.kind == "F" else -act[op.chunk]
        peak = max(peak, live)
    return peak
