"""Train a Column -> GeLU -> Row MLP at tp=2 on process groups made by torch alone.

    torchrun --standalone --nproc-per-node 2 examples/mlp_own_groups.py   # one tp=2 group
    torchrun --standalone --nproc-per-node 4 examples/mlp_own_groups.py   # [0,1] and [2,3]

Needs only torch and pentatron-tp-layers (no pentatron grid is created). Each rank trains
two SGD steps at tp=2 and again on a one-rank group (the unsharded model, same seed), then
checks: the loss went down, the tp=2 losses equal the one-rank losses (fp32, rtol=1e-5) and
every rank of the tp group saw the same losses. A failed check exits non-zero.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from pentatron.tp_layers import ColumnParallelLinear, RowParallelLinear


def tp_groups(tp: int):
    """Consecutive ranks form a tp group; every rank must create every group."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % tp:
        raise SystemExit(f"world size {world} is not a multiple of tp={tp}; launch 2 or 4 ranks")
    groups = [dist.new_group(list(range(i, i + tp))) for i in range(0, world, tp)]
    return groups[rank // tp]


def train(tp_group, steps: int = 2, hidden: int = 16, seed: int = 0) -> list[float]:
    """`steps` SGD steps of an MLP `[8, 2, hidden]` -> `[8, 2, hidden]`; the loss of each."""
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


def check(tp_group) -> list[float]:
    """Train at tp=2 and on one rank, and fail loudly unless the runs agree."""
    tp_losses = train(tp_group)
    # Each rank's own one-rank group: the same model unsharded, the single-process reference.
    solo_losses = train(tp_groups(1))
    if not tp_losses[1] < tp_losses[0]:
        raise SystemExit(f"loss did not decrease over two steps: {tp_losses}")
    torch.testing.assert_close(tp_losses, solo_losses, rtol=1e-5, atol=0)
    # The losses are computed after the row all-reduce, so the ranks of a group must agree.
    # (A tensor all-gather, not all_gather_object: that one needs numpy, not a dependency.)
    mine = torch.tensor(tp_losses)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(tp_group))]
    dist.all_gather(gathered, mine, group=tp_group)
    if any(not torch.equal(other, mine) for other in gathered):
        raise SystemExit(f"ranks of one tp group disagree: {[g.tolist() for g in gathered]}")
    return tp_losses


if __name__ == "__main__":
    dist.init_process_group("gloo")
    losses = check(tp_groups(2))
    print(f"rank {dist.get_rank()}: tp=2 losses {losses} == one-rank losses; OK")
    dist.destroy_process_group()
