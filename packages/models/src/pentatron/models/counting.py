"""Parameter and FLOP counts of a GPT, in closed form (for logging and memory estimates).

`num_parameters` counts the full (tp=1) model from its config; it equals the sum of the
tensor sizes of the single-process GPTModel. `num_floating_point_operations` is
Megatron-LM's formula (training.py, dense model): per layer 12 b s h^2 times
`(1 + ng/nq + s/h) * (nq d / h)` for attention, `(ffn/h) * (3/2 if SwiGLU else 1)` for
the MLP, plus the logits `V / (2 L h)`; 12 = 3 GEMMs per weight (forward, dgrad, wgrad)
x 2 GEMMs x 2 FLOPs per multiply-add. Without attention terms it is the familiar 6N.
`num_floating_point_operations_per_rank` divides the model total by tp * pp * cp.
"""

from __future__ import annotations

from typing import Any

import torch

from .config import TransformerConfig


def _norm_params(config: TransformerConfig, size: int) -> int:
    return size * (2 if config.normalization == "LayerNorm" else 1)


def num_parameters_per_layer(config: TransformerConfig) -> int:
    h, d, ffn = config.hidden_size, config.kv_channels, config.ffn_hidden_size
    assert d is not None and ffn is not None, "TransformerConfig.__post_init__ fills them in"
    qkv_out = config.query_projection_size + 2 * config.kv_projection_size
    fc1_out = ffn * (2 if config.gated_linear_unit else 1)
    bias = config.add_bias_linear
    attn = h * qkv_out + (qkv_out if bias or config.add_qkv_bias else 0)
    attn += config.query_projection_size * h + (h if bias else 0)
    if config.qk_layernorm:
        attn += 2 * _norm_params(config, d)
    mlp = h * fc1_out + ffn * h + ((fc1_out + h) if bias else 0)
    return attn + mlp + 2 * _norm_params(config, h)


def num_parameters(
    config: TransformerConfig,
    padded_vocab_size: int,
    max_sequence_length: int = 0,
    share_embeddings_and_output_weights: bool | None = None,
) -> int:
    """Parameters of the whole model (all stages, tp=1); tied embeddings counted once."""
    tied = (
        config.share_embeddings_and_output_weights
        if share_embeddings_and_output_weights is None
        else share_embeddings_and_output_weights
    )
    h = config.hidden_size
    n = config.num_layers * num_parameters_per_layer(config) + _norm_params(config, h)
    n += padded_vocab_size * h * (1 if tied else 2)
    if config.position_embedding_type == "learned_absolute":
        n += max_sequence_length * h
    return n


def num_parameters_in_model(model: torch.nn.Module) -> int:
    """Sum of the sizes of a module's parameters (this rank's shards)."""
    return sum(p.numel() for p in model.parameters())


def num_floating_point_operations(
    config: TransformerConfig, seq_length: int, padded_vocab_size: int, batch_size: int = 1
) -> float:
    """FLOPs of one training step (forward + backward) on `batch_size` sequences."""
    h, L, s = config.hidden_size, config.num_layers, seq_length
    nq, ng, ffn = config.num_attention_heads, config.num_query_groups, config.ffn_hidden_size
    assert ng is not None and ffn is not None, "TransformerConfig.__post_init__ fills them in"
    gated = 1.5 if config.gated_linear_unit else 1.0
    attention = (1 + ng / nq + s / h) * (config.query_projection_size / h)
    mlp = (ffn / h) * gated
    logits = padded_vocab_size / (2 * L * h)
    return 12 * batch_size * s * L * h * h * (attention + mlp + logits)


def flops_per_token(config: TransformerConfig, seq_length: int, padded_vocab_size: int) -> float:
    """Training FLOPs per token: `num_floating_point_operations / (b s)`."""
    return num_floating_point_operations(config, seq_length, padded_vocab_size) / seq_length


def model_flops_summary(config: TransformerConfig, seq_length: int, vocab: int) -> dict[str, Any]:
    """Parameters (no embeddings) and the 6N approximation next to the full formula."""
    dense = config.num_layers * num_parameters_per_layer(config)
    return {
        "non_embedding_parameters": dense,
        "six_n": 6 * dense,
        "flops_per_token": flops_per_token(config, seq_length, vocab),
    }


def num_floating_point_operations_per_rank(
    config: TransformerConfig, seq_length: int, padded_vocab_size: int, batch_size: int = 1
) -> float:
    """FLOPs one rank does in one step on `batch_size` sequences of its data-parallel group.

    The model total (`num_floating_point_operations`, independent of the layout) is split
    evenly over tp (weights), pp (layers; the logits term is averaged over the stages) and
    cp: each cp rank holds s/cp tokens for every GEMM, and the causal load-balanced chunks
    (r, 2cp-1-r) give every cp rank the same share of the s^2 attention term.
    """
    total = num_floating_point_operations(config, seq_length, padded_vocab_size, batch_size)
    split = (
        config.tensor_model_parallel_size
        * config.pipeline_model_parallel_size
        * config.context_parallel_size
    )
    return total / split
