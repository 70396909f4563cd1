"""GPU check (run where CUDA and transformer-engine exist; not part of CI, and not part
of run_all.py: the project's GPU machine has no transformer-engine, so it has never run):

    torchrun --standalone --nproc-per-node 2 tools/device_checks/tp_layers_te.py

Two MLPs built with backend="te" and backend="torch" from the same seed at tp = world size:
- Column -> GeLU -> Row;
- RMSNorm fused into a stride-2 Column (TE LayerNormLinear, SwiGLU's [gate_r, up_r]
  rows), sequence parallel -> SwiGLU -> Row (reduce-scatter).
Weights are equal by construction; outputs and the input, weight and norm-weight grads must
agree within fp32 GEMM tolerance (TF32 off). Prints one line per rank and check, and exits
non-zero on a mismatch.
"""

import _paths  # noqa: F401  (the repository sources on sys.path)
import torch
import torch.distributed as dist
import torch.nn.functional as F

from pentatron.tp_layers import (
    column_parallel_linear,
    layer_norm_column_parallel_linear,
    row_parallel_linear,
    sync_sequence_parallel_grads,
    te_available,
)


def mlp(backend, group, fused, seed=0):
    torch.manual_seed(seed)
    common = {"tp_group": group, "backend": backend, "device": "cuda"}
    if fused:
        col = layer_norm_column_parallel_linear(
            256, 2048, normalization="RMSNorm", stride=2, sequence_parallel=True, **common
        )
    else:
        col = column_parallel_linear(256, 1024, **common)
    row = row_parallel_linear(1024, 256, input_is_parallel=True, sequence_parallel=fused, **common)
    return col, row


def run(col, row, x, fused, group):
    x = x.clone().requires_grad_(True)
    h = col(x)[0]
    if fused:
        gate, up = h.chunk(2, dim=-1)
        h = F.silu(gate) * up
    else:
        h = F.gelu(h)
    out, _ = row(h)
    out.square().mean().backward()
    sync_sequence_parallel_grads(col, group)
    grads = [x.grad, col.weight.grad, row.weight.grad]
    if fused:
        grads.append(col.layer_norm_weight.grad)
    return [out.detach(), *grads]


def main() -> int:
    dist.init_process_group("nccl")
    torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    torch.backends.cuda.matmul.allow_tf32 = False
    assert te_available(), "transformer-engine is not importable here"
    group = dist.new_group(list(range(dist.get_world_size())))
    x = torch.randn(64, 4, 256, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    ok = True
    for fused in (False, True):
        te_out = run(*mlp("te", group, fused), x, fused, group)
        pt_out = run(*mlp("torch", group, fused), x, fused, group)
        names = ("out", "dx", "dW_col", "dW_row", "d_layer_norm_weight")
        for name, a, b in zip(names, te_out, pt_out):
            err = float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))
            ok &= err < 1e-4
            print(f"rank {dist.get_rank()}: fused={fused} {name} max rel err {err:.2e}")
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
