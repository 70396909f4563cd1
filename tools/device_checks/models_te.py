"""GPU check (run where CUDA and transformer-engine exist; not part of CI, and not part
of run_all.py: the project's GPU machine has no transformer-engine, so it has never run):

    torchrun --standalone --nproc-per-node 2 tools/device_checks/models_te.py

A 2-layer GPT (GQA, RoPE, SwiGLU, RMSNorm) at tp = world size with sequence parallelism,
built with `get_gpt_layer_te_spec()` and `get_gpt_layer_local_spec()`; the TE model
(norms fused into TE LayerNormLinear: `linear_qkv.layer_norm_weight`) loads the local
model's state dict (each layer renames the norm keys), then per-token losses and every
gradient, matched by `global_param_name`, must agree within fp32 GEMM tolerance (TF32
off); the only keys the local state dict lacks must be TE's `_extra_state`. Then FP8 (hybrid, bf16 params,
amax reduced over tp-dp-cp) against the bf16 TE model from the same weights, both trained
30 AdamW steps on one batch: finite losses, both learn (last < half the first), FP8 within
5% of bf16 at every step. Prints one line per rank and exits non-zero on a mismatch.
"""

import dataclasses
import math

import _paths  # noqa: F401  (the repository sources on sys.path)
import torch
import torch.distributed as dist

from pentatron.models import (
    GPTModel,
    TransformerConfig,
    get_gpt_layer_local_spec,
    get_gpt_layer_te_spec,
    global_param_name,
    sync_grads,
)
from pentatron.parallel_state import ParallelConfig, initialize_model_parallel
from pentatron.tp_layers import model_parallel_seed


def build(spec, config, grid):
    model_parallel_seed(1234)
    return GPTModel(config, spec, vocab_size=256, max_sequence_length=128, grid=grid).cuda()


def losses_and_grads(model, ids, pos, labels):
    loss = model(ids, pos, labels=labels)
    loss.mean().backward()
    return loss.detach(), {
        global_param_name(n, model.layer_offset): p.grad for n, p in model.named_parameters()
    }


def main() -> int:
    dist.init_process_group("nccl")
    torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    tp = dist.get_world_size()
    grid = initialize_model_parallel(ParallelConfig(tp=tp))
    config = TransformerConfig(
        num_layers=2,
        hidden_size=256,
        num_attention_heads=8,
        num_query_groups=4,
        ffn_hidden_size=512,
        normalization="RMSNorm",
        activation="swiglu",
        position_embedding_type="rope",
        add_bias_linear=False,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        tensor_model_parallel_size=tp,
        sequence_parallel=tp > 1,
    )
    local = build(get_gpt_layer_local_spec(), config, grid)
    te_model = build(get_gpt_layer_te_spec(), config, grid)
    missing = te_model.load_state_dict(local.state_dict(), strict=False)
    g = torch.Generator("cuda").manual_seed(7)
    ids = torch.randint(0, 256, (2, 128), device="cuda", generator=g)
    labels = torch.randint(0, 256, (2, 128), device="cuda", generator=g)
    pos = torch.arange(128, device="cuda").expand(2, 128)
    want_loss, want = losses_and_grads(local, ids, pos, labels)
    got_loss, got = losses_and_grads(te_model, ids, pos, labels)
    fused = type(te_model.decoder.layers[0].self_attention.linear_qkv).__mro__[1].__name__
    ok = not missing.unexpected_keys and fused == "LayerNormLinear"
    ok &= all(k.endswith("_extra_state") for k in missing.missing_keys)
    rank = dist.get_rank()
    print(f"rank {rank}: linear_qkv is a TE {fused}")
    print(
        f"rank {rank}: TE-only state keys {missing.missing_keys} unexpected {missing.unexpected_keys}"
    )
    err = float((got_loss - want_loss).abs().max() / want_loss.abs().max())
    ok &= err < 1e-4
    print(f"rank {rank}: loss max rel err {err:.2e}")
    for name, grad in want.items():
        e = float((got[name] - grad).abs().max() / grad.abs().max().clamp(min=1e-12))
        ok &= e < 1e-3
        print(f"rank {rank}: grad {name} max rel err {e:.2e}")
    ok &= fp8_close_to_bf16(config, grid, ids, pos, labels, rank)
    dist.destroy_process_group()
    return 0 if ok else 1


FP8_STEPS = 30


def train_losses(model, ids, pos, labels) -> list[float]:
    """`FP8_STEPS` AdamW steps on one batch (so the loss must fall far), the loss before each."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    out = []
    for _ in range(FP8_STEPS):
        opt.zero_grad(set_to_none=True)
        loss = model(ids, pos, labels=labels).float().mean()
        loss.backward()
        sync_grads(model)  # sequence-parallel norm weights: their tp-partial grads summed
        opt.step()
        out.append(float(loss))
    return out


def fp8_close_to_bf16(config, grid, ids, pos, labels, rank) -> bool:
    """FP8 (hybrid) and bf16 TE models from the same weights, trained the same: every loss
    finite, both runs learn (the last loss under half the first), and FP8's loss stays
    within 5% of bf16's at every step (FP8 rounding; the scales warm up from the amax
    history), so a broken FP8 backward (which a forward at init cannot show) fails."""
    bf16 = dataclasses.replace(config, params_dtype=torch.bfloat16)
    ref = build(get_gpt_layer_te_spec(), bf16, grid).bfloat16()
    fp8 = build(get_gpt_layer_te_spec(), dataclasses.replace(bf16, fp8="hybrid"), grid)
    fp8.load_state_dict(ref.state_dict())
    want = train_losses(ref, ids, pos, labels)
    got = train_losses(fp8, ids, pos, labels)
    ok = all(math.isfinite(v) for v in want + got)
    ok &= want[-1] < 0.5 * want[0] and got[-1] < 0.5 * got[0]
    worst = max(abs(g - w) / abs(w) for g, w in zip(got, want))
    ok &= worst < 0.05
    print(
        f"rank {rank}: fp8 vs bf16 over {FP8_STEPS} AdamW steps: first {got[0]:.4f} / "
        f"{want[0]:.4f}, last {got[-1]:.4f} / {want[-1]:.4f}, worst rel {worst:.2e}"
    )
    return ok


if __name__ == "__main__":
    raise SystemExit(main())
