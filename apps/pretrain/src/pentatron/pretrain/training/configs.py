"""Validated arguments -> the packages' config dataclasses (one place, no logic elsewhere)."""

from __future__ import annotations

import argparse
from datetime import timedelta

import torch

from pentatron.models import RopeScaling, TransformerConfig
from pentatron.optim import DDPConfig, OptimizerConfig, OptimizerParamScheduler
from pentatron.parallel_state import ParallelConfig
from pentatron.pipeline import PipelineConfig, PipelineLayout


def params_dtype(args: argparse.Namespace) -> torch.dtype:
    return torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32


def parallel_config(args: argparse.Namespace) -> ParallelConfig:
    return ParallelConfig(
        tp=args.tensor_model_parallel_size,
        pp=args.pipeline_model_parallel_size,
        vpp=args.virtual_pipeline_model_parallel_size,
        cp=args.context_parallel_size,
        ep=args.expert_model_parallel_size,
        etp=args.expert_tensor_parallel_size,
        timeout=timedelta(minutes=args.distributed_timeout_minutes),
        hierarchical_cp=_hierarchical_cp(args),
        embedding_pp_ranks=None if (r := standalone_mtp_rank(args)) is None else (0, r),
    )


def standalone_mtp_rank(args: argparse.Namespace) -> int | None:
    """The pipeline rank of a custom layout's standalone MTP stage (None without one): it
    holds an embedding copy, so the embedding group joins it to the first stage."""
    text = getattr(args, "pipeline_model_parallel_layout", None)
    if text is None or not args.mtp_num_layers:
        return None
    return PipelineLayout.parse(text, args.pipeline_model_parallel_size).mtp_standalone_rank


def _hierarchical_cp(args: argparse.Namespace) -> tuple[int, ...] | None:
    sizes = args.hierarchical_context_parallel_sizes
    return None if sizes is None else tuple(sizes)


def transformer_config(args: argparse.Namespace) -> TransformerConfig:
    return TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        kv_channels=args.kv_channels,
        ffn_hidden_size=args.ffn_hidden_size,
        normalization=args.normalization,
        layernorm_epsilon=args.norm_epsilon,
        activation="swiglu" if args.swiglu else "quick_geglu" if args.quick_geglu else "gelu",
        glu_linear_offset=args.glu_linear_offset,
        activation_func_clamp_value=args.activation_func_clamp_value,
        softmax_type=args.softmax_type,
        window_size=args.window_size,
        window_attn_skip_freq=args.window_attn_skip_freq,
        bias_activation_fusion=args.swiglu and args.bias_swiglu_fusion,
        add_bias_linear=args.add_bias_linear,
        add_qkv_bias=args.add_qkv_bias,
        qk_layernorm=args.qk_layernorm,
        position_embedding_type=args.position_embedding_type,
        rotary_base=args.rotary_base,
        rotary_percent=args.rotary_percent,
        # Megatron's --use-rope-scaling: Llama 3.x's low/high freq factors and original length
        rope_scaling=RopeScaling(factor=args.rope_scaling_factor)
        if args.use_rope_scaling
        else None,
        init_method_std=args.init_method_std,
        attention_dropout=args.attention_dropout,
        hidden_dropout=args.hidden_dropout,
        untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights,
        sequence_parallel=args.sequence_parallel,
        recompute_granularity=args.recompute_granularity,
        recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
        recompute_modules=args.recompute_modules,
        layernorm_zero_centered_gamma=args.apply_layernorm_1p,
        attention_backend=args.attention_backend,
        params_dtype=params_dtype(args),
        fp8=args.fp8_format,
        fp8_margin=args.fp8_margin,
        fp8_amax_history_len=args.fp8_amax_history_len,
        fp8_amax_compute_algo=args.fp8_amax_compute_algo,
        gradient_accumulation_fusion=args.gradient_accumulation_fusion,
        multi_latent_attention=args.multi_latent_attention,
        q_lora_rank=args.q_lora_rank,
        kv_lora_rank=args.kv_lora_rank,
        qk_head_dim=args.qk_head_dim,
        qk_pos_emb_head_dim=args.qk_pos_emb_head_dim,
        v_head_dim=args.v_head_dim,
        mtp_num_layers=args.mtp_num_layers,
        mtp_loss_scaling_factor=args.mtp_loss_scaling_factor,
        **yarn_fields(args),
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        pipeline_placement="v" if getattr(args, "pipeline_schedule", None) == "zbv" else "loop",
        context_parallel_size=args.context_parallel_size,
        cp_comm_type=args.cp_comm_type,
        hierarchical_context_parallel_sizes=args.hierarchical_context_parallel_sizes,
        num_layers_in_first_pipeline_stage=args.decoder_first_pipeline_num_layers,
        num_layers_in_last_pipeline_stage=args.decoder_last_pipeline_num_layers,
        account_for_embedding_in_pipeline_split=args.account_for_embedding_in_pipeline_split,
        account_for_loss_in_pipeline_split=args.account_for_loss_in_pipeline_split,
        pipeline_model_parallel_layout=args.pipeline_model_parallel_layout,
        calculate_per_token_loss=args.calculate_per_token_loss,
        enable_cuda_graph=args.enable_cuda_graph,
        cuda_graph_warmup_steps=args.cuda_graph_warmup_steps,
        **moe_fields(args),
    )


def yarn_fields(args: argparse.Namespace) -> dict:
    """MLA's YaRN: Megatron's flags, None meaning MLATransformerConfig's defaults."""
    out: dict = {
        "rotary_scaling_factor": args.rotary_scaling_factor,
        "mscale": args.mscale,
        "mscale_all_dim": args.mscale_all_dim,
    }
    named = {
        "yarn_original_max_position_embeddings": args.yarn_original_max_position_embeddings,
        "yarn_beta_fast": args.yarn_beta_fast,
        "yarn_beta_slow": args.yarn_beta_slow,
        "yarn_correction_range_round_to_int": args.yarn_correction_range_round_to_int,
    }
    out.update({k: v for k, v in named.items() if v is not None})
    return out


def moe_fields(args: argparse.Namespace) -> dict:
    """TransformerConfig's MoE fields from the Megatron MoE flags (empty for a dense run)."""
    if not args.num_experts:
        return {"expert_model_parallel_size": args.expert_model_parallel_size}
    names = (
        "moe_layer_freq",
        "moe_ffn_hidden_size",
        "moe_router_topk",
        "moe_router_score_function",
        "moe_router_pre_softmax",
        "moe_router_topk_scaling_factor",
        "moe_router_num_groups",
        "moe_router_group_topk",
        "moe_router_load_balancing_type",
        "moe_aux_loss_coeff",
        "moe_z_loss_coeff",
        "moe_router_enable_expert_bias",
        "moe_router_bias_update_rate",
        "moe_input_jitter_eps",
        "moe_expert_capacity_factor",
        "moe_token_drop_policy",
        "moe_pad_expert_input_to_capacity",
        "moe_token_dispatcher_type",
        "moe_grouped_gemm",
        "moe_shared_expert_intermediate_size",
        "moe_shared_expert_overlap",
        "moe_shared_expert_gate",
        "moe_router_dtype",
        "moe_router_force_load_balancing",
        "expert_model_parallel_size",
        "expert_tensor_parallel_size",
    )
    return {"num_moe_experts": args.num_experts, **{n: getattr(args, n) for n in names}}


def ddp_config(args: argparse.Namespace) -> DDPConfig:
    return DDPConfig(
        # Megatron: bf16 / fp16 grads accumulate and reduce in fp32, unless --grad-reduce-in-bf16
        grad_reduce_in_fp32=(args.accumulate_allreduce_grads_in_fp32 or args.bf16 or args.fp16)
        and not args.grad_reduce_in_bf16,
        overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather,
        use_distributed_optimizer=args.use_distributed_optimizer,
        bucket_size=args.ddp_bucket_size,
        # The step checks loss and grads itself, agreed by every rank (training/step.py):
        # DDP's own check raises on the one bad rank and leaves the others waiting.
        check_for_nan_in_grad=False,
    )


def optimizer_config(args: argparse.Namespace) -> OptimizerConfig:
    return OptimizerConfig(
        optimizer=args.optimizer,
        lr=args.lr,
        min_lr=args.min_lr,
        weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2,
        adam_eps=args.adam_eps,
        sgd_momentum=args.sgd_momentum,
        clip_grad=args.clip_grad,
        log_num_zeros_in_grad=args.log_num_zeros_in_grad,
        bf16=args.bf16,
        fp16=args.fp16,
        loss_scale=args.loss_scale,
        initial_loss_scale=args.initial_loss_scale,
        min_loss_scale=args.min_loss_scale,
        loss_scale_window=args.loss_scale_window,
        hysteresis=args.hysteresis,
        use_distributed_optimizer=args.use_distributed_optimizer,
        decoupled_lr=args.decoupled_lr,
        decoupled_min_lr=args.decoupled_min_lr,
    )


def scheduler_increment(args: argparse.Namespace, global_batch: int) -> int:
    """What one iteration advances the schedule by: its samples with --train-samples (the
    batch ramp-up included), else 1 (Megatron's rule)."""
    return global_batch if args.train_samples is not None else 1


def scheduler(args: argparse.Namespace, optimizer) -> OptimizerParamScheduler:
    """Megatron's schedule: its steps are samples when training by --train-samples (warm-up
    --lr-warmup-samples, decay --lr-decay-samples), else iterations."""
    by_samples = args.train_samples is not None
    return OptimizerParamScheduler(
        optimizer,
        init_lr=args.lr_warmup_init,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_samples if by_samples else args.lr_warmup_iters,
        lr_decay_steps=args.lr_decay_samples if by_samples else args.lr_decay_iters,
        lr_decay_style=args.lr_decay_style,
        start_wd=args.start_weight_decay,
        end_wd=args.end_weight_decay,
        wd_incr_steps=args.train_samples if by_samples else args.train_iters,
        wd_incr_style=args.weight_decay_incr_style,
        use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=args.override_opt_param_scheduler,
        wsd_decay_steps=args.lr_wsd_decay_samples if by_samples else args.lr_wsd_decay_iters,
        lr_wsd_decay_style=args.lr_wsd_decay_style,
    )


def pipeline_config(args: argparse.Namespace, **hooks) -> PipelineConfig:
    # Megatron's rule: the interleaved schedule overlaps p2p unless told not to, and then
    # posts single sends and receives (batch_p2p_comm = not overlap_p2p_comm)
    interleaved = args.virtual_pipeline_model_parallel_size is not None and getattr(
        args, "pipeline_schedule", None
    ) in (None, "interleaved")
    overlap = bool(getattr(args, "overlap_p2p_comm", True)) and interleaved
    return PipelineConfig(
        overlap_p2p_comm=overlap,
        batch_p2p_comm=not overlap,
        hidden_size=args.hidden_size,
        pipeline_dtype=params_dtype(args),
        sequence_parallel=args.sequence_parallel,
        calculate_per_token_loss=args.calculate_per_token_loss,
        # a standalone MTP stage sends h_0 and every depth's output: (1 + D) s rows
        variable_seq_lengths=standalone_mtp_rank(args) is not None,
        **hooks,
    )
