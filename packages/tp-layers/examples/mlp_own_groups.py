"""Train a Column -> GeLU -> Row MLP at tp=2 on process groups made by torch alone.

    torchrun --nproc-per-node 4 examples/mlp_own_groups.py      # tp groups [0,1] and [2,3]

Needs only torch and pentatron-tp-layers (no pentatron grid is created). Each tp group
sees the same data, so every rank prints the same two losses for its group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from pentatron.tp_layers import ColumnParallelLinear, RowParallelLinear


def tp_groups(tp: int):
    """Consecutive ranks form a tp group; every rank must create every group."""
    world, rank = dist.get_world_size(), dist.get_rank()
    groups = [dist.new_group(list(range(i, i + tp))) for i in range(0, world, tp)]
    return groups[rank // tp]


def train(tp_group, steps: int = 2, hidden: int = 16, seed: int = 0) -> list[float]:
    torch.manual_seed(seed)  # same seed on the tp group: same master weights, same data
    fc1 = ColumnParallelLinear(hidden, 4 * hidden, tp_group=tp_group)
    fc2 = RowParallelLinear(4 * hidden, hidden, tp_group=tp_group, input_is_parallel=True)
    params = [*fc1.parameters(), *fc2.parameters()]
    opt = torch.optim.SGD(params, lr=0.5)
    x, target = torch.randn(8, 2, hidden), torch.randn(8, 2, hidden)
    losses = []
    for _ in range(steps):
        y, _ = fc2(F.gelu(fc1(x)[0]))
        loss = F.mse_loss(y, target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


if __name__ == "__main__":
    dist.init_process_group("gloo")
    print(f"rank {dist.get_rank()}: losses {train(tp_groups(2))}")
    dist.destroy_process_group()
