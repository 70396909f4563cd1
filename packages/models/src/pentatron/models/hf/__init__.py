"""pentatron.models.hf: Hugging Face Llama / Mixtral / Qwen2-MoE / DeepSeek-V3 / gpt-oss
<-> GPTModel (config, weights, sharded load at any tp / pp / ep / etp, CLI).

    model = from_hf(MixtralForCausalLM.from_pretrained(path))      # one process
    model = load_hf_checkpoint_shard(path, grid)                    # this rank's shard only
    hf_state_dict = to_hf(model)                                    # tp/etp/ep shards gathered
    config, vocab_size, max_seq_len, extras = config_from_hf(hf_config)
    hf_config = config_to_hf(config, vocab_size, max_seq_len, extras)

MoE experts: transformers >= 5 holds them fused (`experts.gate_up_proj`), its checkpoint
files and transformers 4 per expert; reading takes either, writing the one asked for
(`expert_layout`, default: the installed transformers'; see moe_map.py). gpt-oss's experts
are read unquantised or in MXFP4 (dequantised as read) and written unquantised
(gpt_oss_map.py).
transformers is imported only by `config_to_hf` (and by nothing else here): converting a
safetensors checkpoint directory works without it. CLI: `pentatron-convert` (see cli.py).
"""

from .config_map import HFConfigError, config_from_hf, config_to_hf, config_to_hf_dict
from .convert import (
    from_hf,
    hf_shard_state_dict,
    load_from_source,
    load_hf_checkpoint_shard,
    read_param_shard,
    to_hf,
)
from .moe_map import FUSED, PER_EXPERT, default_expert_layout, hf_arch
from .mxfp4 import dequantize_mxfp4, held
from .safetensors_io import SafetensorsDirSource
from .state_map import DictSource, TensorSource, chunk_param_names, full_to_hf, read_shard

__all__ = [
    "FUSED",
    "PER_EXPERT",
    "DictSource",
    "HFConfigError",
    "SafetensorsDirSource",
    "TensorSource",
    "chunk_param_names",
    "config_from_hf",
    "config_to_hf",
    "config_to_hf_dict",
    "default_expert_layout",
    "dequantize_mxfp4",
    "from_hf",
    "full_to_hf",
    "hf_arch",
    "held",
    "hf_shard_state_dict",
    "load_from_source",
    "load_hf_checkpoint_shard",
    "read_param_shard",
    "read_shard",
    "to_hf",
]
