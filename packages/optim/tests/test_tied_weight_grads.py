"""A weight used twice in one backward (a tied embedding: the lookup, and the output layer
through `ColumnParallelLinear(x, weight=...)`) gets the sum of both grads in `main_grad`.

Regression: the output layer accumulated its part straight into `main_grad` and flagged
`grad_added_to_main_grad`, so DDP's hook dropped the lookup's part that autograd had summed
into the same `.grad`. One process, fp32, compared with plain autograd (tolerance 1e-6).
"""

import torch

from pentatron.optim import DDPConfig, DistributedDataParallel, finalize_model_grads
from pentatron.parallel_state import (
    ParallelConfig,
    destroy_model_parallel,
    initialize_model_parallel,
)

V, H, S, B = 32, 8, 5, 2


class Tied(torch.nn.Module):
    def __init__(self, grid):
        super().__init__()
        from pentatron.tp_layers import ColumnParallelLinear, VocabParallelEmbedding

        torch.manual_seed(0)
        tp = grid.group("tp")
        self.emb = VocabParallelEmbedding(V, H, tp_group=tp)
        self.out = ColumnParallelLinear(
            H, V, bias=False, skip_weight_param_allocation=True, tp_group=tp
        )

    def forward(self, ids):
        h = torch.tanh(self.emb(ids)).transpose(0, 1)  # [s, b, h]
        logits, _ = self.out(h, weight=self.emb.weight)
        return logits.float().pow(2).mean()


def _grads():
    grid = initialize_model_parallel(ParallelConfig())
    try:
        ids = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(1))
        plain = Tied(grid)
        plain(ids).backward()
        want = plain.emb.weight.grad.clone()
        ddp = DistributedDataParallel(DDPConfig(), Tied(grid), grid=grid)
        ddp(ids).backward()
        finalize_model_grads([ddp], grid=grid)
        return want, ddp.module.emb.weight.main_grad.clone()
    finally:
        destroy_model_parallel(grid)


def test_tied_weight_main_grad_holds_both_uses(distributed):
    want, got = distributed.run(1, _grads)[0]
    assert want.abs().sum() > 0
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
