"""GPU check (run where CUDA and transformer-engine exist; not part of CI):

    torchrun --standalone --nproc-per-node 2 tools/device_checks/tp_layers_te.py

A Column -> GeLU -> Row MLP built with backend="te" and backend="torch" from the same seed at
tp = world size: weights equal, outputs and input / weight grads equal within fp32 GEMM
tolerance (TF32 off). Prints one line per rank and exits non-zero on a mismatch.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from pentatron.tp_layers import column_parallel_linear, row_parallel_linear, te_available


def mlp(backend, group, seed=0):
    torch.manual_seed(seed)
    col = column_parallel_linear(256, 1024, tp_group=group, backend=backend, device="cuda")
    row = row_parallel_linear(
        1024, 256, tp_group=group, input_is_parallel=True, backend=backend, device="cuda"
    )
    return col, row


def run(col, row, x):
    x = x.clone().requires_grad_(True)
    out, _ = row(F.gelu(col(x)[0]))
    out.square().mean().backward()
    return out.detach(), x.grad, col.weight.grad, row.weight.grad


def main() -> int:
    dist.init_process_group("nccl")
    torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    torch.backends.cuda.matmul.allow_tf32 = False
    assert te_available(), "transformer-engine is not importable here"
    group = dist.new_group(list(range(dist.get_world_size())))
    x = torch.randn(64, 4, 256, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    te_out = run(*mlp("te", group), x)
    pt_out = run(*mlp("torch", group), x)
    ok = True
    for name, a, b in zip(("out", "dx", "dW_col", "dW_row"), te_out, pt_out):
        err = float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))
        ok &= err < 1e-4
        print(f"rank {dist.get_rank()}: {name} max rel err {err:.2e}")
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
