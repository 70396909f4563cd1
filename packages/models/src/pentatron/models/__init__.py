"""pentatron.models: TransformerConfig, layer specs, GPTModel and Hugging Face conversion.

    config = TransformerConfig(num_layers=4, hidden_size=64, num_attention_heads=8, ...)
    model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=100,
                     max_sequence_length=128, grid=grid)
    loss = model(input_ids, position_ids, labels=labels)   # [b, s]

Conversion to and from Hugging Face Llama lives in `pentatron.models.hf`.
"""

from importlib.metadata import version as _distribution_version

from .attention import DotProductAttention, SelfAttention, SelfAttentionSubmodules
from .config import ModelConfigError, RopeScaling, TransformerConfig
from .context_parallel import (
    RingAttention,
    a2a_attention,
    all_gather_attention,
    check_cp_seq_len,
    context_parallel_attention,
    cp_positions,
    gather_cp_shards,
    get_batch_on_this_cp_rank,
    ring_attention,
    shard_for_cp_rank,
)
from .counting import (
    flops_per_token,
    num_floating_point_operations,
    num_floating_point_operations_per_rank,
    num_parameters,
    num_parameters_in_model,
)
from .cuda_graphs import CudaGraphError, LayerCudaGraphs, cuda_capture, eager_capture
from .embedding import LanguageModelEmbedding
from .gpt_model import GPTModel, build_model_chunks
from .grads import allreduce_tied_embedding_grads, sync_grads
from .layer_specs import get_gpt_layer_local_spec, get_gpt_layer_te_spec
from .mla import MLASelfAttention, MLASelfAttentionSubmodules, apply_mla_rope
from .mlp import MLP, MLPSubmodules
from .moe import GroupedMLP, MoELayer, MoESubmodules, SequentialMLP, SharedExpertMLP
from .moe.aux_tracker import collect_moe_aux_losses, reset_moe_aux_losses
from .moe.expert_bias import reset_expert_bias_counts, update_expert_bias
from .moe.load_balancing import get_aux_loss_scale, set_aux_loss_scale
from .moe.router import TopKRouter
from .mtp import MultiTokenPredictionBlock, MultiTokenPredictionLayer, mtp_loss, roll_left
from .norm import LayerNorm, Norm, RMSNorm
from .parallel import ModelParallel
from .recompute import CheckpointWithoutOutput
from .rope import RotaryEmbedding, apply_rotary_pos_emb, rope_inv_freq
from .sdpa import ATTENTION_BACKENDS, attention_backend_needs_cuda
from .sharding import (
    ParamSharding,
    global_param_name,
    load_full_state_dict,
    local_param_name,
    merge_shards,
    param_sharding,
    shard_full_tensor,
    state_tensors,
)
from .spec import ModuleSpec, build_linear, build_module
from .te_spec import HAVE_TE
from .transformer_block import TransformerBlock, get_layer_offset, get_num_layers_to_build
from .transformer_layer import TransformerLayer, TransformerLayerSubmodules

# the installed distribution's version, so it never drifts from pyproject.toml
__version__ = _distribution_version("pentatron-models")

__all__ = [
    "ATTENTION_BACKENDS",
    "CheckpointWithoutOutput",
    "attention_backend_needs_cuda",
    "CudaGraphError",
    "LayerCudaGraphs",
    "cuda_capture",
    "eager_capture",
    "GroupedMLP",
    "MoELayer",
    "MoESubmodules",
    "SequentialMLP",
    "SharedExpertMLP",
    "RingAttention",
    "a2a_attention",
    "all_gather_attention",
    "check_cp_seq_len",
    "context_parallel_attention",
    "cp_positions",
    "gather_cp_shards",
    "get_batch_on_this_cp_rank",
    "num_floating_point_operations_per_rank",
    "ring_attention",
    "shard_for_cp_rank",
    "TopKRouter",
    "collect_moe_aux_losses",
    "get_aux_loss_scale",
    "reset_moe_aux_losses",
    "set_aux_loss_scale",
    "reset_expert_bias_counts",
    "update_expert_bias",
    "HAVE_TE",
    "MLP",
    "DotProductAttention",
    "GPTModel",
    "LanguageModelEmbedding",
    "LayerNorm",
    "MLPSubmodules",
    "ModelConfigError",
    "ModelParallel",
    "ModuleSpec",
    "Norm",
    "ParamSharding",
    "RMSNorm",
    "RopeScaling",
    "RotaryEmbedding",
    "MLASelfAttention",
    "MLASelfAttentionSubmodules",
    "SelfAttention",
    "apply_mla_rope",
    "MultiTokenPredictionBlock",
    "MultiTokenPredictionLayer",
    "mtp_loss",
    "roll_left",
    "SelfAttentionSubmodules",
    "TransformerBlock",
    "TransformerConfig",
    "TransformerLayer",
    "TransformerLayerSubmodules",
    "__version__",
    "allreduce_tied_embedding_grads",
    "apply_rotary_pos_emb",
    "build_model_chunks",
    "build_linear",
    "build_module",
    "flops_per_token",
    "get_gpt_layer_local_spec",
    "get_gpt_layer_te_spec",
    "get_layer_offset",
    "get_num_layers_to_build",
    "global_param_name",
    "load_full_state_dict",
    "local_param_name",
    "merge_shards",
    "num_floating_point_operations",
    "num_parameters",
    "num_parameters_in_model",
    "param_sharding",
    "rope_inv_freq",
    "shard_full_tensor",
    "state_tensors",
    "sync_grads",
]
