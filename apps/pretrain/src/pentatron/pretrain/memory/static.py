"""Static memory per rank: weights, grad buffers, fp32 main params, optimizer state.

Exact for Pentatron's implementation, because it replays what the code allocates:
1. `stage_parameters` lists this rank's parameters in `module.parameters()` order (shapes of
   one tp / ep shard), per model chunk;
2. DDP puts them, reversed, into one buffer per kind (dense / expert) and lays it out with
   `pentatron.optim`'s `plan_layout` (with the distributed optimizer: params start on a
   64-element boundary, buckets padded to lcm(dp, 128));
3. bytes:
   - weights = sum of param sizes x param bytes (distributed optimizer: the padded param
     buffer, since params live in it);
   - grads = padded buffer numel x grad bytes (fp32 with bf16/fp16; else the param dtype);
   - main params = fp32 copies of the (owned shard of the) params, only when params are
     not fp32 (an fp32 model steps its own storage);
   - optimizer = Adam m and v in fp32 (SGD: momentum) per main element, plus torch's
     4-byte `step` tensor per main-param piece.
   With the distributed optimizer a dp rank owns 1/dp of every bucket and keeps main params
   and state only for the param pieces inside it. Per param: bf16 + Adam gives
   2 + 4 + 12 = 18 bytes, or 2 + 4 + 12/d with the distributed optimizer: Megatron's 6 + 12/d.
"""

from __future__ import annotations

from dataclasses import dataclass

from pentatron.optim.distributed.grad_buffer import plan_layout

from .plan import MemoryPlan


@dataclass(frozen=True)
class ParamSpec:
    name: str
    numel: int
    expert: bool = False
    shared_embedding: bool = False
    rows: int | None = None  # its dim 0 (FSDP2 shards it); None: a vector, numel

    @property
    def dim0(self) -> int:
        return self.numel if self.rows is None else self.rows


def _norm(plan: MemoryPlan, prefix: str, size: int) -> list[ParamSpec]:
    out = [ParamSpec(f"{prefix}.weight", size)]
    if plan.config.normalization == "LayerNorm":
        out.append(ParamSpec(f"{prefix}.bias", size))
    return out


def _linear(name: str, out_f: int, in_f: int, bias: bool, expert=False) -> list[ParamSpec]:
    specs = [ParamSpec(f"{name}.weight", out_f * in_f, expert, rows=out_f)]
    return specs + ([ParamSpec(f"{name}.bias", out_f, expert)] if bias else [])


def _mla(plan: MemoryPlan, p: str) -> list[ParamSpec]:
    """MLASelfAttention, in construction order: q (direct, or down, up and the latent norm),
    kv down (latent and k_pe rows), kv up, the kv latent norm, linear_proj; the
    down-projections whole on every tp rank (duplicated), the other linears split by
    output rows over tp, linear_proj by its input columns (heads)."""
    c, t, h = plan.config, plan.tp, plan.config.hidden_size
    n, q_out = (
        c.num_attention_heads,
        c.num_attention_heads * (c.qk_head_dim + c.qk_pos_emb_head_dim),
    )
    norms = c.qk_layernorm
    if c.q_lora_rank is None:
        out = _linear(f"{p}.linear_q_proj", q_out // t, h, False)
    else:
        r = c.q_lora_rank
        out = _linear(f"{p}.linear_q_down_proj", r, h, False)
        out += _linear(f"{p}.linear_q_up_proj", q_out // t, r, False)
        out += _norm(plan, f"{p}.q_layernorm", r) if norms else []
    r_kv = c.kv_lora_rank
    out += _linear(f"{p}.linear_kv_down_proj", r_kv + c.qk_pos_emb_head_dim, h, False)
    out += _linear(f"{p}.linear_kv_up_proj", n * (c.qk_head_dim + c.v_head_dim) // t, r_kv, False)
    out += _norm(plan, f"{p}.kv_layernorm", r_kv) if norms else []
    out += _linear(f"{p}.linear_proj", h, n * c.v_head_dim // t, False)
    if c.add_bias_linear:
        out.append(ParamSpec(f"{p}.linear_proj.bias", h))
    return out


def _attention(plan: MemoryPlan, p: str) -> list[ParamSpec]:
    c, t = plan.config, plan.tp
    if c.multi_latent_attention:
        return _mla(plan, p)
    qkv = (c.query_projection_size + 2 * c.kv_projection_size) // t
    out = _linear(f"{p}.linear_qkv", qkv, c.hidden_size, c.add_bias_linear or c.add_qkv_bias)
    if c.softmax_type == "learnable":  # gpt-oss's sinks, one per head, split by heads
        out.append(ParamSpec(f"{p}.core_attention.softmax_offset", c.num_attention_heads // t))
    out += _linear(f"{p}.linear_proj", c.hidden_size, c.query_projection_size // t, False)
    if c.add_bias_linear:
        out.append(ParamSpec(f"{p}.linear_proj.bias", c.hidden_size))
    if c.qk_layernorm:
        out += _norm(plan, f"{p}.q_layernorm", c.kv_channels)
        out += _norm(plan, f"{p}.k_layernorm", c.kv_channels)
    return out


def _dense_mlp(plan: MemoryPlan, p: str, ffn: int) -> list[ParamSpec]:
    c, t = plan.config, plan.tp
    f1 = ffn * (2 if c.gated_linear_unit else 1)
    out = _linear(f"{p}.linear_fc1", f1 // t, c.hidden_size, c.add_bias_linear)
    out += _linear(f"{p}.linear_fc2", c.hidden_size, ffn // t, c.add_bias_linear)
    return out


def _moe(plan: MemoryPlan, p: str) -> list[ParamSpec]:
    """Router [E, h] (+ bias [E]); experts stacked [E/ep, F1/etp, h] and [E/ep, h, F/etp] (+ biases);
    shared experts a dense MLP split over tp (+ its gate [1, h] when gated)."""
    c = plan.config
    e_local, f = c.num_moe_experts // plan.ep, c.moe_ffn_size
    f1 = f * (2 if c.gated_linear_unit else 1)
    out = [
        ParamSpec(f"{p}.router.weight", c.num_moe_experts * c.hidden_size, rows=c.num_moe_experts)
    ]
    if c.add_bias_linear:  # Megatron's router logit bias
        out.append(ParamSpec(f"{p}.router.bias", c.num_moe_experts))
    h, etp = c.hidden_size, plan.etp
    fc1, fc2 = f"{p}.experts.linear_fc1", f"{p}.experts.linear_fc2"
    out.append(ParamSpec(f"{fc1}.weight", e_local * (f1 // etp) * h, True, rows=e_local))
    if c.add_bias_linear:
        out.append(ParamSpec(f"{fc1}.bias", e_local * (f1 // etp), True, rows=e_local))
    out.append(ParamSpec(f"{fc2}.weight", e_local * h * (f // etp), True, rows=e_local))
    if c.add_bias_linear:
        out.append(ParamSpec(f"{fc2}.bias", e_local * h, True, rows=e_local))
    if c.moe_shared_expert_intermediate_size:
        out += _dense_mlp(plan, f"{p}.shared_experts", c.moe_shared_expert_intermediate_size)
        if c.moe_shared_expert_gate:  # Qwen2-MoE's sigmoid gate, replicated over tp
            out.append(ParamSpec(f"{p}.shared_experts.gate_weight", h, rows=1))
    return out


def chunk_layers(plan: MemoryPlan, pp_rank: int, vp: int) -> range:
    layout = plan.config.stage_layout()
    off = layout.layer_offset(pp_rank, vp)
    return range(off, off + layout.num_layers_to_build(pp_rank, vp))


def is_first_chunk(plan: MemoryPlan, pp_rank: int, vp: int) -> bool:
    return pp_rank == 0 and vp == 0


def is_last_chunk(plan: MemoryPlan, pp_rank: int, vp: int) -> bool:
    """The chunk holding the output layer: the last rank's last chunk, or with ZBV's V
    placement rank 0's chunk 1 (stage 2p - 1)."""
    if plan.config.pipeline_placement == "v":
        return pp_rank == 0 and vp == 1
    return pp_rank == plan.pp - 1 and vp == plan.vpp - 1


def chunk_parameters(plan: MemoryPlan, pp_rank: int, vp: int) -> list[ParamSpec]:
    """This rank's params of chunk `vp`, in `GPTModel.parameters()` order."""
    c, h = plan.config, plan.config.hidden_size
    first, last = is_first_chunk(plan, pp_rank, vp), is_last_chunk(plan, pp_rank, vp)
    tied = c.share_embeddings_and_output_weights
    vocab = plan.padded_vocab_size // plan.tp
    # MTP on the last stage (or a custom layout's standalone MTP stage): it holds a copy of
    # the embedding, tied over the pipeline
    mtp = c.mtp_on(pp_rank, vp, last)
    split_mtp = bool(c.mtp_num_layers) and plan.pp > 1
    out: list[ParamSpec] = []
    if first or mtp:
        out.append(
            ParamSpec(
                "embedding.word_embeddings.weight", vocab * h, False, tied or split_mtp, vocab
            )
        )
        if c.position_embedding_type == "learned_absolute":
            positions = plan.max_position_embeddings or plan.seq_length
            out.append(
                ParamSpec(
                    "embedding.position_embeddings.weight",
                    positions * h,
                    False,
                    split_mtp,
                    positions,
                )
            )
    for i, layer in enumerate(chunk_layers(plan, pp_rank, vp)):
        out += _layer(plan, f"decoder.layers.{i}", layer + 1)
    if c.final_norm_on(pp_rank, vp, last):
        out += _norm(plan, "decoder.final_layernorm", h)
    for k in range(c.mtp_num_layers or 0) if mtp else ():
        p = f"mtp.layers.{k}"
        out += _norm(plan, f"{p}.enorm", h) + _norm(plan, f"{p}.hnorm", h)
        out += _linear(f"{p}.eh_proj", h // plan.tp, 2 * h, False)
        out += _layer(plan, f"{p}.mtp_model_layer", c.num_layers + k + 1)
        out += _norm(plan, f"{p}.final_layernorm", h)
    if last and (not tied or not (first or mtp)):
        out.append(ParamSpec("output_layer.weight", vocab * h, False, tied, vocab))
    return out


def _layer(plan: MemoryPlan, p: str, layer_number: int) -> list[ParamSpec]:
    """One transformer layer (`layer_number` 1-based; past num_layers: an MTP layer)."""
    c, h = plan.config, plan.config.hidden_size
    out = _norm(plan, f"{p}.input_layernorm", h)
    out += _attention(plan, f"{p}.self_attention")
    out += _norm(plan, f"{p}.pre_mlp_layernorm", h)
    if c.is_moe and c.is_moe_layer(layer_number):
        return out + _moe(plan, f"{p}.mlp")
    return out + _dense_mlp(plan, f"{p}.mlp", c.ffn_hidden_size)


@dataclass
class StaticBytes:
    num_parameters: int = 0
    weights_bytes: int = 0
    grads_bytes: int = 0
    main_params_bytes: int = 0
    optimizer_bytes: int = 0

    def add(self, other: StaticBytes) -> None:
        for k in vars(self):
            setattr(self, k, getattr(self, k) + getattr(other, k))


def _buffer_bytes(plan: MemoryPlan, params: list[ParamSpec], dp: int, dp_rank: int) -> StaticBytes:
    """One DDP buffer (params already reversed) on dp rank `dp_rank` of `dp`."""
    sharded = plan.use_distributed_optimizer
    own = [sharded and p.shared_embedding for p in params]
    lay = plan_layout([p.numel for p in params], plan.bucket_size, dp, sharded, own)
    n = sum(p.numel for p in params)
    if sharded:  # main params: the pieces of params inside this rank's shard of each bucket
        pieces, main = 0, 0
        for (b0, b1), members in zip(lay.bucket_ranges, lay.bucket_params):
            size = (b1 - b0) // dp
            lo, hi = b0 + dp_rank * size, b0 + (dp_rank + 1) * size
            for i in members:
                a, b = max(lay.param_ranges[i][0], lo), min(lay.param_ranges[i][1], hi)
                if a < b:
                    pieces, main = pieces + 1, main + (b - a)
    else:
        pieces, main = len(params), n
    state_per_elem = {"adam": 8, "sgd": 4}[plan.optimizer]
    fp32 = plan.param_bytes == 4
    return StaticBytes(
        num_parameters=n,
        weights_bytes=(lay.numel if sharded else n) * plan.param_bytes,
        grads_bytes=lay.numel * plan.grad_bytes,
        main_params_bytes=0 if fp32 else main * 4,
        optimizer_bytes=main * state_per_elem + pieces * 4,  # + torch's `step` per piece
    )


def fsdp2_on_edp(plan: MemoryPlan, p: ParamSpec) -> bool:
    """Experts split over ep: the app shards them over their edp ranks."""
    return p.expert and plan.ep > 1


def fsdp2_shards(plan: MemoryPlan, p: ParamSpec) -> int:
    """The ranks FSDP2 cuts `p` over: dp x cp, or for experts split over ep their edp."""
    return plan.edp if fsdp2_on_edp(plan, p) else plan.dp * plan.cp


def _fsdp2_bytes(
    plan: MemoryPlan, params: list[ParamSpec], rank: int, expert_rank: int
) -> StaticBytes:
    """FSDP2 over D ranks (`fsdp2_shards`), this rank `rank` of them (`expert_rank` for
    experts over edp): every param (widened to fp32: the shards are the main params) cut
    along dim 0 into D parts of ceil(rows / D) rows, each rank's stored padded to that; its
    grad the same (one flat fp32 buffer per FSDP unit); optimizer state over the rows this
    rank holds, plus `step` per param."""
    padded = held = 0
    for p in params:
        d = fsdp2_shards(plan, p)
        r = expert_rank if fsdp2_on_edp(plan, p) else rank
        rows, cols = p.dim0, p.numel // p.dim0
        part = -(-rows // d)
        padded += part * cols
        held += max(0, min(part, rows - r * part)) * cols
    state_per_elem = {"adam": 8, "sgd": 4}[plan.optimizer]
    return StaticBytes(
        num_parameters=sum(p.numel for p in params),
        weights_bytes=padded * 4,
        grads_bytes=padded * 4,
        main_params_bytes=0,
        optimizer_bytes=held * state_per_elem + len(params) * 4,
    )


def static_bytes(
    plan: MemoryPlan, pp_rank: int, dp_rank: int = 0, edp_rank: int = 0
) -> StaticBytes:
    """Static bytes of one rank of pipeline stage `pp_rank` (all its virtual chunks);
    `dp_rank` is its rank in dp x cp (the dense buffer's group, or FSDP2's)."""
    total = StaticBytes()
    for vp in range(plan.vpp):
        if plan.use_torch_fsdp2:
            params = chunk_parameters(plan, pp_rank, vp)
            total.add(_fsdp2_bytes(plan, params, dp_rank, edp_rank))
            continue
        params = list(reversed(chunk_parameters(plan, pp_rank, vp)))
        dense = [p for p in params if not p.expert]
        expert = [p for p in params if p.expert]
        if dense:
            total.add(_buffer_bytes(plan, dense, plan.dp * plan.cp, dp_rank))
        if expert:
            total.add(_buffer_bytes(plan, expert, plan.edp, edp_rank))
    return total
