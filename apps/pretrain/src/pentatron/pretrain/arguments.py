"""Command-line arguments with Megatron-LM's flag names, plus `--config file.yaml`.

A YAML file's keys are the same names as the flags (dashes or underscores: both
`tensor-model-parallel-size: 2` and `tensor_model_parallel_size: 2`); flags given on the
command line override the file. Unknown keys are an error naming the key, as unknown flags
are. `validate_args` checks everything that can be checked before a process group exists;
each failure is one `ArgumentError` line naming the flag, the rule and a fix.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

from .arguments_compat import add_compat_args
from .arguments_logging import add_logging_args
from .arguments_validate import ArgumentError, validate_args
from .tokenizer.arguments import add_tokenizer_file_args

__all__ = ["ArgumentError", "build_parser", "parse_args", "validate_args"]


def _gpt_oss(g: Any) -> None:
    """gpt-oss's activation and attention variants (Megatron's TransformerConfig flags)."""
    g.add_argument(
        "--quick-geglu",
        action="store_true",
        help="gpt-oss's gated activation: quick_gelu(gate) * up, quick_gelu(x) = x sigmoid(1.702 x)",
    )
    g.add_argument(
        "--glu-linear-offset", type=float, default=0.0, help="gated: act(gate) * (up + offset)"
    )
    g.add_argument(
        "--activation-func-clamp-value",
        type=float,
        default=None,
        help="gated: gate clamped to <= value, up to [-value, value] (gpt-oss: 7.0)",
    )
    g.add_argument(
        "--softmax-type",
        default="vanilla",
        choices=["vanilla", "off-by-one", "learnable"],
        help="attention sinks: a per-head logit added to the softmax denominator",
    )
    g.add_argument(
        "--window-size",
        type=parse_window_size,
        default=None,
        help="sliding-window attention LEFT,0: query i sees keys i-LEFT..i (gpt-oss: 127,0)",
    )
    g.add_argument(
        "--window-attn-skip-freq",
        type=parse_window_attn_skip_freq,
        default=None,
        help="N: every N-th layer full attention, the rest windowed; or a 0/1 list (1: window)",
    )


def _model(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=None, help="required")
    g.add_argument("--hidden-size", type=int, default=None, help="required")
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="default: 4 * hidden")
    g.add_argument("--num-attention-heads", type=int, default=None, help="required")
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--num-query-groups", type=int, default=1, help="with --group-query-attention")
    g.add_argument("--kv-channels", type=int, default=None)
    g.add_argument("--seq-length", type=int, default=None, help="required")
    g.add_argument(
        "--max-position-embeddings", type=int, default=None, help="required, >= --seq-length"
    )
    g.add_argument(
        "--position-embedding-type",
        default="learned_absolute",
        choices=["learned_absolute", "rope", "yarn", "none"],
    )
    g.add_argument("--rotary-base", type=float, default=10000.0)
    g.add_argument("--rotary-percent", type=float, default=1.0)
    g.add_argument(
        "--use-rope-scaling",
        action="store_true",
        help="Llama-3.x RoPE frequency scaling (low/high freq factors 1/4, original length 8192)",
    )
    g.add_argument("--rope-scaling-factor", type=float, default=8.0)
    g.add_argument(
        "--no-position-embedding",
        dest="add_position_embedding",
        action="store_false",
        help="deprecated in Megatron: refused unless --position-embedding-type rope",
    )
    g.add_argument(
        "--apply-layernorm-1p",
        action="store_true",
        help="zero-centred norm weights, applied as (1 + weight)",
    )
    g.add_argument("--normalization", default="LayerNorm", choices=["LayerNorm", "RMSNorm"])
    g.add_argument("--norm-epsilon", type=float, default=1e-5)
    g.add_argument("--swiglu", action="store_true")
    g.add_argument(
        "--no-bias-swiglu-fusion",
        dest="bias_swiglu_fusion",
        action="store_false",
        help="SwiGLU through plain autograd, which also keeps silu(gate) for backward",
    )
    _gpt_oss(g)
    g.add_argument("--disable-bias-linear", dest="add_bias_linear", action="store_false")
    g.add_argument("--add-qkv-bias", action="store_true")
    g.add_argument("--qk-layernorm", action="store_true", help="with MLA: its latent norms")
    g.add_argument(
        "--multi-latent-attention",
        action="store_true",
        help="DeepSeek-V2/V3 attention: q and kv through low-rank latents (the local spec)",
    )
    g.add_argument("--q-lora-rank", type=int, default=None, help="MLA: None = no q latent")
    g.add_argument("--kv-lora-rank", type=int, default=32)
    g.add_argument("--qk-head-dim", type=int, default=128)
    g.add_argument("--qk-pos-emb-head-dim", type=int, default=64)
    g.add_argument("--v-head-dim", type=int, default=128)
    g.add_argument(
        "--mtp-num-layers",
        type=int,
        default=None,
        help="multi-token prediction depths (DeepSeek-V3), on the last pipeline stage",
    )
    g.add_argument(
        "--mtp-loss-scaling-factor",
        type=float,
        default=0.1,
        help="weight of the MTP loss (averaged over the depths)",
    )
    g.add_argument(
        "--rope-type",
        default=None,
        choices=["rope", "yarn"],
        help="MLA's RoPE (default yarn, as Megatron's; standard attention: rope only)",
    )
    g.add_argument("--rotary-scaling-factor", type=float, default=1.0, help="YaRN's factor")
    g.add_argument("--mscale", type=float, default=1.0, help="YaRN: cos/sin temperature")
    g.add_argument("--mscale-all-dim", type=float, default=0.0, help="YaRN: softmax scale")
    g.add_argument("--yarn-original-max-position-embeddings", type=int, default=None)
    g.add_argument("--yarn-beta-fast", type=float, default=None)
    g.add_argument("--yarn-beta-slow", type=float, default=None)
    g.add_argument("--yarn-correction-range-round-to-int", action="store_true", default=None)
    g.add_argument(
        "--no-yarn-correction-range-round-to-int",
        action="store_false",
        dest="yarn_correction_range_round_to_int",
    )
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument(
        "--attention-backend",
        default="auto",
        choices=["flash", "fused", "unfused", "local", "auto"],
        help="the SDPA kernel: flash (FlashAttention), fused (cuDNN / memory-efficient), "
        "unfused and local (PyTorch maths), auto (SDPA chooses)",
    )
    g.add_argument("--recompute-activations", action="store_true", help="= selective")
    g.add_argument("--recompute-granularity", default=None, choices=["full", "selective"])
    g.add_argument("--recompute-modules", nargs="*", default=None)
    g.add_argument("--recompute-method", default=None, choices=["uniform", "block"])
    g.add_argument("--recompute-num-layers", type=int, default=None)
    g.add_argument(
        "--transformer-impl",
        default="transformer_engine",
        choices=["local", "transformer_engine"],
        help="transformer_engine falls back to local (same numerics) where it is not "
        "installed or there is no GPU, said once at start-up",
    )
    g.add_argument("--fp8-format", default=None, choices=["e4m3", "hybrid"])
    g.add_argument("--fp8-margin", type=int, default=0, help="scaling-factor margin")
    g.add_argument("--fp8-amax-history-len", type=int, default=1)
    g.add_argument("--fp8-amax-compute-algo", default="most_recent", choices=["most_recent", "max"])
    g.add_argument(
        "--no-gradient-accumulation-fusion",
        dest="gradient_accumulation_fusion",
        action="store_false",
        help="weight grads into a temporary, then added to main_grad (not fused)",
    )
    g.add_argument(
        "--disable-bf16-reduced-precision-matmul",
        action="store_true",
        help="cuBLAS bf16 GEMMs keep full-precision reductions",
    )
    g.add_argument(
        "--enable-cuda-graph",
        action="store_true",
        help="CUDA graphs of the transformer layers, captured after the warm-up steps",
    )
    g.add_argument("--cuda-graph-warmup-steps", type=int, default=3)
    g.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile each transformer layer in place (torchtitan's per-layer compile)",
    )
    g.add_argument(
        "--compile-backend",
        default=None,
        choices=["inductor", "aot_eager", "eager"],
        help="the torch.compile backend with --compile (default: inductor)",
    )


def _parallel(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    g.add_argument("--virtual-pipeline-model-parallel-size", type=int, default=None)
    g.add_argument(
        "--pipeline-schedule",
        default=None,
        choices=["1f1b", "interleaved", "zb-h1", "zbv"],
        help="default: 1f1b, or interleaved with virtual stages (Megatron's choice); zb-h1: "
        "zero-bubble H1 (backward split into input and weight gradients); zbv: zero-bubble V "
        "(two chunks per rank in a V; needs --untie-embeddings-and-output-weights)",
    )
    g.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None)
    g.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None)
    g.add_argument("--num-virtual-stages-per-pipeline-rank", type=int, default=None)
    # Megatron's default: interleaved schedules overlap their p2p with compute (single
    # sends and receives, not batched); 1F1B and the zero-bubble schedules batch them
    g.add_argument("--no-overlap-p2p-communication", dest="overlap_p2p_comm", action="store_false")
    g.add_argument(
        "--pipeline-model-parallel-layout",
        default=None,
        help="Megatron's custom layout: E embedding, t transformer layer, m MTP layer, L loss; "
        "'|' separates virtual stages (round robin over the pp ranks), x*n and (...)*n repeat, "
        "commas are cosmetic; e.g. 'Et*3|(tt|)*29,|mL'. Sets the virtual stages per rank",
    )
    g.add_argument("--account-for-embedding-in-pipeline-split", action="store_true")
    g.add_argument("--account-for-loss-in-pipeline-split", action="store_true")
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--context-parallel-size", type=int, default=1)
    g.add_argument(
        "--cp-comm-type",
        nargs="+",
        default=["p2p"],
        choices=["p2p", "allgather", "all_gather", "a2a", "a2a+p2p"],
        help="one type for every layer (Megatron's per-layer list is accepted when all agree); "
        "a2a+p2p: all-to-all over the first level of --hierarchical-context-parallel-sizes, "
        "the ring over the second",
    )
    g.add_argument(
        "--hierarchical-context-parallel-sizes",
        nargs="+",
        type=int,
        default=None,
        help="sizes of the cp levels, the first over adjacent cp ranks: '2 4' = all-to-all "
        "over pairs (inside a node), the ring over the 4 pairs; their product is "
        "--context-parallel-size",
    )
    g.add_argument("--expert-model-parallel-size", type=int, default=1)
    g.add_argument("--expert-tensor-parallel-size", type=int, default=None, help="default: tp")
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument(
        "--use-torch-fsdp2",
        action="store_true",
        help="shard params, grads and optimizer state over dp x cp with torch FSDP2",
    )
    g.add_argument("--overlap-grad-reduce", action="store_true")
    g.add_argument("--overlap-param-gather", action="store_true")
    g.add_argument("--ddp-bucket-size", type=int, default=None)
    g.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true")
    g.add_argument(
        "--grad-reduce-in-bf16", action="store_true", help="with --bf16: grads reduced in bf16"
    )
    g.add_argument("--distributed-timeout-minutes", type=float, default=10.0)
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])


def parse_window_size(text: Any) -> tuple[int, int]:
    """--window-size: Megatron's tuple_type, `127,0` or `(127,0)`."""
    if isinstance(text, (tuple, list)):
        return tuple(int(x) for x in text)  # type: ignore[return-value]
    parts = str(text).strip("()[] ").split(",")
    try:
        left, right = (int(x) for x in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--window-size {text!r}: expected LEFT,RIGHT, e.g. 127,0"
        ) from None
    return left, right


def parse_moe_layer_freq(text: Any) -> int | list[int]:
    """--moe-layer-freq: `N` (every N-th layer), a list `[0,1,1,1]` / `0,1,1,1`, or
    Megatron's pattern `[0]*1+[1]*3` (parsed here; never evaluated)."""
    return _parse_layer_pattern(text, "--moe-layer-freq")


def parse_window_attn_skip_freq(text: Any) -> int | list[int]:
    """--window-attn-skip-freq: as --moe-layer-freq (N, or a 0/1 list; 1 = sliding window)."""
    return _parse_layer_pattern(text, "--window-attn-skip-freq")


# parsers that take a whole list from a config file (others convert item by item)
_LIST_PARSERS = (parse_moe_layer_freq, parse_window_attn_skip_freq)


def _parse_layer_pattern(text: Any, flag: str) -> int | list[int]:
    if isinstance(text, (int, list)):
        return text
    src = str(text).replace(" ", "")
    if src.isdigit():
        return int(src)
    if re.fullmatch(r"[01](,[01])*", src):
        return [int(x) for x in src.split(",")]
    out: list[int] = []
    for term in src.split("+"):
        m = re.fullmatch(r"\[([01](?:,[01])*)\](?:\*(\d+))?", term)
        if m is None:
            raise argparse.ArgumentTypeError(
                f"{flag} {text!r}: expected N, 0,1,1,1, [0,1,1,1] or [0]*1+[1]*3"
            )
        out += [int(x) for x in m.group(1).split(",")] * int(m.group(2) or 1)
    return out


def _moe(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("mixture of experts")
    g.add_argument("--num-experts", type=int, default=None)
    g.add_argument("--moe-layer-freq", type=parse_moe_layer_freq, default=1)
    g.add_argument("--moe-ffn-hidden-size", type=int, default=None)
    g.add_argument("--moe-router-topk", type=int, default=2)
    g.add_argument("--moe-router-score-function", default="softmax", choices=["softmax", "sigmoid"])
    g.add_argument("--moe-router-pre-softmax", action="store_true")
    g.add_argument("--moe-router-topk-scaling-factor", type=float, default=None)
    g.add_argument("--moe-router-num-groups", type=int, default=None)
    g.add_argument("--moe-router-group-topk", type=int, default=None)
    g.add_argument(
        "--moe-router-load-balancing-type",
        default="aux_loss",
        choices=["aux_loss", "seq_aux_loss", "sinkhorn", "none"],
    )
    g.add_argument("--moe-aux-loss-coeff", type=float, default=0.0)
    g.add_argument("--moe-z-loss-coeff", type=float, default=None)
    g.add_argument("--moe-router-enable-expert-bias", action="store_true")
    g.add_argument("--moe-router-bias-update-rate", type=float, default=1e-3)
    g.add_argument("--moe-input-jitter-eps", type=float, default=None)
    g.add_argument("--moe-expert-capacity-factor", type=float, default=None)
    g.add_argument("--moe-token-drop-policy", default="probs", choices=["probs", "position"])
    g.add_argument("--moe-pad-expert-input-to-capacity", action="store_true")
    g.add_argument(
        "--moe-token-dispatcher-type",
        default="allgather",
        choices=["allgather", "alltoall", "flex"],
        help="flex (DeepEP / HybridEP kernels) is refused: it needs those GPU packages",
    )
    g.add_argument("--moe-router-dtype", default=None, choices=["fp32", "fp64"])
    g.add_argument("--moe-router-force-load-balancing", action="store_true")
    g.add_argument("--moe-grouped-gemm", action="store_true")
    g.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None)
    g.add_argument("--moe-shared-expert-overlap", action="store_true")
    g.add_argument(
        "--moe-shared-expert-gate",
        action="store_true",
        help="sigmoid(x @ gate) scales the shared experts' output (Qwen2-MoE)",
    )


def _optimizer(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("optimizer and schedule")
    g.add_argument("--optimizer", default="adam", choices=["adam", "sgd"])
    g.add_argument("--lr", type=float, default=None, help="required")
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument(
        "--lr-decay-style",
        default="linear",
        choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"],
    )
    g.add_argument("--lr-decay-iters", type=int, default=None)
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-fraction", type=float, default=None)
    g.add_argument("--lr-warmup-init", type=float, default=0.0)
    g.add_argument("--lr-decay-samples", type=int, default=None)
    g.add_argument("--lr-warmup-samples", type=int, default=0)
    g.add_argument("--lr-wsd-decay-samples", type=int, default=None)
    g.add_argument(
        "--decoupled-lr", type=float, default=None, help="lr of the embedding and output layer"
    )
    g.add_argument("--decoupled-min-lr", type=float, default=None)
    g.add_argument("--lr-wsd-decay-iters", type=int, default=None)
    g.add_argument("--lr-wsd-decay-style", default="exponential")
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--start-weight-decay", type=float, default=None)
    g.add_argument("--end-weight-decay", type=float, default=None)
    g.add_argument("--weight-decay-incr-style", default="constant")
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--sgd-momentum", type=float, default=0.9)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--loss-scale", type=float, default=None)
    g.add_argument("--initial-loss-scale", type=float, default=2.0**32)
    g.add_argument("--min-loss-scale", type=float, default=1.0)
    g.add_argument("--loss-scale-window", type=int, default=1000)
    g.add_argument("--hysteresis", type=int, default=2)
    g.add_argument("--log-num-zeros-in-grad", action="store_true")
    g.add_argument("--override-opt_param-scheduler", action="store_true")
    g.add_argument("--use-checkpoint-opt_param-scheduler", action="store_true")


def _training(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=None, help="required")
    g.add_argument("--global-batch-size", type=int, default=None, help="default: mbs * dp")
    g.add_argument("--rampup-batch-size", type=int, nargs=3, default=None)
    g.add_argument("--train-iters", type=int, default=None)
    g.add_argument("--train-samples", type=int, default=None)
    g.add_argument("--exit-interval", type=int, default=None)
    g.add_argument("--exit-duration-in-mins", type=float, default=None)
    g.add_argument(
        "--exit-signal-handler",
        action="store_true",
        help="on SIGTERM/SIGINT finish the iteration, save (with --save) and exit 0 "
        "(Megatron's flag and default: off, the signals keep their default action)",
    )
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument(
        "--eval-interval",
        type=int,
        default=None,
        help="evaluate every N iterations (default: only after the last one)",
    )
    g.add_argument("--eval-iters", type=int, default=100)
    g.add_argument(
        "--no-check-for-nan-in-loss-and-grad",
        dest="check_for_nan_in_loss_and_grad",
        action="store_false",
        help="skip the per-step finiteness check of the grads (the loss is always checked); "
        "--fp16 with dynamic loss scaling turns it off, as Megatron does",
    )
    g.add_argument(
        "--on-nan-loss",
        default="stop",
        choices=["stop", "skip"],
        help="a NaN/Inf loss stops the run (default) or skips the optimizer step",
    )
    g.add_argument("--calculate-per-token-loss", action="store_true")


def _data(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data and tokenizer")
    g.add_argument("--data-path", nargs="*", default=None)
    g.add_argument("--split", default=None, help="default with --data-path: 969, 30, 1")
    g.add_argument("--mock-data", action="store_true")
    g.add_argument("--data-cache-path", default=None)
    g.add_argument(
        "--dataloader-type", default=None, choices=["single", "cyclic"], help="default: single"
    )
    g.add_argument("--num-workers", type=int, default=2)
    g.add_argument(
        "--no-mmap-bin-files",
        dest="mmap_bin_files",
        action="store_false",
        help="read the .bin files into memory instead of mapping them",
    )
    g.add_argument("--tokenizer-type", default=None)
    add_tokenizer_file_args(g)
    g.add_argument("--reset-position-ids", action="store_true")
    g.add_argument("--reset-attention-mask", action="store_true")
    g.add_argument("--eod-mask-loss", action="store_true")


def _checkpointing(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("checkpointing")
    g.add_argument("--save", default=None)
    g.add_argument("--load", default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--no-load-optim", action="store_true", default=None)
    g.add_argument("--no-load-rng", action="store_true", default=None)
    g.add_argument("--no-save-optim", action="store_true", default=None)
    g.add_argument("--finetune", action="store_true")
    g.add_argument(
        "--pretrained-checkpoint",
        default=None,
        help="weights to start from when --load holds no checkpoint (iteration 0, fresh "
        "optimizer): a Hugging Face directory (config.json + *.safetensors) or a checkpoint "
        "of this app",
    )
    g.add_argument(
        "--use-checkpoint-args",
        action="store_true",
        help="model flags not given take their values from --pretrained-checkpoint's config",
    )
    g.add_argument(
        "--export-hf-dir",
        default=None,
        help="after training, write the model as a Hugging Face checkpoint to this new directory",
    )
    g.add_argument("--ckpt-step", type=int, default=None, help="load this iteration, not latest")
    g.add_argument("--async-save", action="store_true")
    g.add_argument("--ckpt-keep-last", type=int, default=None)
    g.add_argument(
        "--auto-detect-ckpt-format",
        action="store_true",
        help="read --load's format from the checkpoint (legacy formats are refused by name)",
    )
    g.add_argument(
        "--dist-ckpt-strictness",
        default="assume_ok_unexpected",
        choices=[
            "assume_ok_unexpected",
            "log_unexpected",
            "log_all",
            "raise_unexpected",
            "raise_all",
            "return_unexpected",
            "return_all",
            "ignore_all",
        ],
        help="what loading does with keys the checkpoint and the model do not share",
    )
    g.add_argument(
        "--ckpt-format",
        default="torch_dist",
        help="torch_dist only: the sharded format we write (others are refused in validation)",
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pentatron-pretrain",
        description="Megatron-style GPT pretraining (launch with torchrun).",
        # as Megatron-LM's parser: no prefix matching, so a Megatron flag that starts like
        # one of ours (--exit-signal, --exit-signal-handler) is never taken for it
        allow_abbrev=False,
    )
    p.add_argument("--config", default=None, help="YAML file; keys are these flags' names")
    for add in (
        _model,
        _parallel,
        _moe,
        _optimizer,
        _training,
        _data,
        _checkpointing,
        add_logging_args,
        add_compat_args,
    ):
        add(p)
    return p


def yaml_defaults(parser: argparse.ArgumentParser, path: str) -> dict[str, Any]:
    import yaml

    text = Path(path).read_text()
    data = yaml.safe_load(text) or {}
    if not isinstance(data, dict):
        raise ArgumentError(f"--config {path}: the file must hold a mapping of flag: value")
    by_flag = {o[2:].replace("-", "_"): a for a in parser._actions for o in a.option_strings}
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = str(key).lstrip("-").replace("-", "_")
        action = by_flag.get(name)
        if action is None or action.dest in ("config", "help"):
            from .megatron_flags import MEGATRON_FLAGS

            why = (
                "a Megatron-LM flag this release does not implement; fix: drop it"
                if "--" + name.replace("_", "-") in MEGATRON_FLAGS
                else "the rule: keys are the flag names (see pentatron-pretrain --help)"
            )
            raise ArgumentError(f"--config {path}: unknown key {key!r}; {why}")
        dest = action.dest
        if action.nargs == 0:  # a switch: `true` gives the flag, `false` leaves the default
            if not isinstance(value, bool):
                raise ArgumentError(
                    f"--config {path}: key {key!r} is a switch; fix: write true or false"
                )
            if value:
                out[dest] = action.const
            continue
        convert = action.type
        if convert is not None and value is not None:
            if not callable(convert):  # argparse also allows a registered name; ours are callables
                raise ArgumentError(
                    f"--config {path}: key {key!r}: type {convert!r} is not callable"
                )
            if isinstance(value, list) and convert not in _LIST_PARSERS:
                value = [convert(v) for v in value]
            else:
                value = convert(value)
        choices = action.choices
        if action.nargs in ("+", "*") and value is not None and not isinstance(value, list):
            value = [value]
        if isinstance(value, list) and action.nargs in ("+", "*"):
            bad = [v for v in value if choices is not None and v not in choices]
        else:
            bad = [] if choices is None or value in choices else [value]
        if bad:
            raise ArgumentError(
                f"--config {path}: key {key!r}: {value!r} is not one of {list(choices or [])}; "
                "fix: use one of them (as on the command line)"
            )
        out[dest] = value
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Flags over `--config` over the defaults; not yet validated (see `validate_args`)."""
    parser = build_parser()
    first, _ = parser.parse_known_args(argv)
    from_yaml: dict[str, Any] = {}
    if first.config:
        from_yaml = yaml_defaults(parser, first.config)
        parser.set_defaults(**from_yaml)
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        raise ArgumentError(_unknown_argument(parser, unknown))
    args.explicit_flags = sorted(set(from_yaml) | _given_on_command_line(argv))
    return args


def _unknown_argument(parser: argparse.ArgumentParser, unknown: list[str]) -> str:
    """One line for what argparse left over: a Megatron-LM flag we lack, a typo, or a
    stray value."""
    from .megatron_flags import unknown_flag_message

    flags = [token.split("=", 1)[0] for token in unknown if token.startswith("--")]
    if flags:
        ours = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
        return unknown_flag_message(flags[0], ours)
    return (
        f"unexpected argument {unknown[0]!r}: pentatron-pretrain takes flags only; fix: drop "
        "it, or give it to the flag it belongs to"
    )


def _given_on_command_line(argv: list[str] | None) -> set[str]:
    """The dests of the flags `argv` names (a flag given its default value counts)."""
    parser = build_parser()
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    given, _ = parser.parse_known_args(argv)
    return set(vars(given)) - {"config"}
