"""Shared pieces of the models tests: a small Llama-like GPT config, seeded data, and the
single-process reference (losses and grads of the full model with gradient accumulation)."""

from __future__ import annotations

import dataclasses

import torch

from pentatron.models import GPTModel, TransformerConfig, get_gpt_layer_local_spec

VOCAB, S, B, M = 100, 16, 2, 4  # vocab, sequence, micro-batch size, micro-batches
DIVISIBLE_BY = 32  # padded vocab = 128 at tp in {1, 2, 4}
TOL = {"rtol": 1e-5, "atol": 1e-6}  # fp32: tp/sp/pp change only the order of sums
# DeepSeek's multi-latent attention at the small config's size (8 heads; q / kv latents)
MLA = dict(
    multi_latent_attention=True,
    q_lora_rank=16,
    kv_lora_rank=12,
    qk_head_dim=8,
    qk_pos_emb_head_dim=4,
    v_head_dim=6,
    num_query_groups=None,
)

# gpt-oss's variants at the small config's size: learnable sinks, a 4-key window on every
# second layer, quick-GeGLU with the linear offset and a clamp the tiny model's fc1 crosses
GPT_OSS = dict(
    softmax_type="learnable",
    window_size=(3, 0),
    window_attn_skip_freq=2,
    activation="quick_geglu",
    glu_linear_offset=1.0,
    activation_func_clamp_value=0.3,
)


def small_config(**overrides) -> TransformerConfig:
    """4 layers, GQA (8 heads, 4 groups), RoPE, SwiGLU, RMSNorm, biases and q/k norm."""
    base = dict(
        num_layers=4,
        hidden_size=32,
        num_attention_heads=8,
        num_query_groups=4,
        ffn_hidden_size=64,
        normalization="RMSNorm",
        activation="swiglu",
        position_embedding_type="rope",
        add_bias_linear=True,
        qk_layernorm=True,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        init_method_std=0.1,
    )
    base.update(overrides)
    return TransformerConfig(**base)


def with_layout(config: TransformerConfig, tp: int, pp: int, vpp, sp: bool) -> TransformerConfig:
    return dataclasses.replace(
        config,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        sequence_parallel=sp,
    )


def microbatches(
    m: int = M, seed: int = 3
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(input_ids [b, s], position_ids [b, s], labels [b, s]) per micro-batch."""
    g = torch.Generator().manual_seed(seed)
    pos = torch.arange(S).expand(B, S).contiguous()
    out = []
    for _ in range(m):
        ids = torch.randint(0, VOCAB, (B, S), generator=g)
        labels = torch.randint(0, VOCAB, (B, S), generator=g)
        out.append((ids, pos, labels))
    return out


def build_reference(config: TransformerConfig, seed: int = 0, **kwargs) -> GPTModel:
    torch.manual_seed(seed)
    kwargs.setdefault("make_vocab_size_divisible_by", DIVISIBLE_BY)
    spec = get_gpt_layer_local_spec(multi_latent_attention=config.multi_latent_attention)
    return GPTModel(config, spec, VOCAB, S, **kwargs)


def reference_run(config: TransformerConfig, data, **kwargs):
    """Full state dict, per-token losses [b, s] per micro-batch, and grads (mean loss / m)."""
    model = build_reference(config, **kwargs)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    losses = []
    for ids, pos, labels in data:
        loss = model(ids, pos, labels=labels)
        (loss.mean() / len(data)).backward()
        losses.append(loss.detach())
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return state, losses, grads
