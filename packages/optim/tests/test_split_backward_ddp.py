"""DDP with overlapped grad reduce under a split backward (tp-layers' WeightGradStore, as the
zero-bubble pipeline schedule drives it): a bucket is launched only once its params' W ran.

dp2, two micro-batches, fp32: B of the last micro-batch runs with sync on. The norm's
bucket (its grad comes in B) launches then; the linears' buckets do not (autograd calls
their hook in B with no gradient: DDP must not mark them ready). W of the first micro-batch
runs with sync off, W of the last with sync on: then they launch, and after
finish_grad_sync every main_grad is the dp average of plain autograd's grads (rtol 1e-6).
"""

import torch

from pentatron.optim import DDPConfig, DistributedDataParallel
from pentatron.parallel_state import (
    ParallelConfig,
    comm,
    destroy_model_parallel,
    initialize_model_parallel,
)

S, B, H = 4, 2, 8


class _Net(torch.nn.Module):
    def __init__(self, tp_group):
        super().__init__()
        from pentatron.tp_layers import ColumnParallelLinear, RowParallelLinear

        torch.manual_seed(0)
        self.norm = torch.nn.LayerNorm(H)
        self.fc1 = ColumnParallelLinear(H, 2 * H, tp_group=tp_group)
        self.fc2 = RowParallelLinear(2 * H, H, input_is_parallel=True, tp_group=tp_group)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(self.norm(x))[0]))[0].pow(2).mean()


def _launched(ddp, param) -> bool:
    buffer = ddp.param_to_buffer[param]
    return buffer.param_to_bucket[param].grad_launched


def _run():
    from pentatron.tp_layers import WeightGradStore

    grid = initialize_model_parallel(ParallelConfig())
    try:
        rank = grid.rank("dp")
        data = [
            torch.randn(S, B, H, generator=torch.Generator().manual_seed(10 * rank + k))
            for k in range(2)
        ]
        plain = _Net(grid.group("tp"))
        for x in data:
            (plain(x) / 2).backward()
        want = {n: p.grad.clone() for n, p in plain.named_parameters()}
        for g in want.values():
            comm.all_reduce(g, group=grid.group("dp"))
            g /= 2

        config = DDPConfig(overlap_grad_reduce=True, bucket_size=1)  # a bucket per param
        ddp = DistributedDataParallel(config, _Net(grid.group("tp")), grid=grid)
        store = WeightGradStore()
        for k, x in enumerate(data):
            last = k == len(data) - 1
            with ddp.no_sync() if not last else torch.enable_grad():
                loss = ddp(x) / 2
                with store.defer():
                    loss.backward()
                store.close_group()
        net = ddp.module
        after_b = {n: _launched(ddp, p) for n, p in net.named_parameters()}
        with ddp.no_sync():
            store.run_oldest()  # W of micro-batch 0: only accumulates
        store.run_oldest()  # W of the last micro-batch: the linears' buckets launch
        after_w = {n: _launched(ddp, p) for n, p in net.named_parameters()}
        ddp.finish_grad_sync()
        got = {n: p.main_grad.clone() for n, p in net.named_parameters()}
        return after_b, after_w, got, want
    finally:
        destroy_model_parallel(grid)


def test_a_bucket_waits_for_its_weight_gradients(distributed):
    for after_b, after_w, got, want in distributed.run(2, _run):
        # The norm's grads and fc2's bias (added after the linear) come in B.
        in_b = {"norm.weight", "norm.bias", "fc2.bias"}
        assert {n for n, launched in after_b.items() if launched} == in_b
        assert all(after_w.values())
        for name, g in want.items():
            torch.testing.assert_close(got[name], g, rtol=1e-6, atol=1e-7, msg=name)
