"""DDP's overlapped param all-gather with modules compiled in place (`module.compile()`).

DDP waits for a module's params in a forward pre-hook; inside a compiled module those
hooks run traced, where Dynamo cannot wait on a handle. So DDP waits for every param
before the wrapped model runs and the traced hooks do nothing: the compiled blocks read the
gathered params (every all-gather finished before the first block runs, checked by an eager
hook), compile without a graph break, and two DDP wrappers around two chunks of blocks
share one compiled code.
"""

import torch

from pentatron.optim import DDPConfig, DistributedDataParallel
from pentatron.parallel_state import ParallelConfig, initialize_model_parallel


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(8)
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(self.norm(x)))


def _chunk(n: int, seed: int) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    blocks = torch.nn.Sequential(*(_Block() for _ in range(n)))
    for block in blocks:
        block.compile(backend="aot_eager")
    return blocks


def _forward_after_async_gather():
    import torch._dynamo
    from torch._dynamo.utils import counters

    grid = initialize_model_parallel(ParallelConfig())  # dp2
    config = DDPConfig(use_distributed_optimizer=True, overlap_param_gather=True)
    torch._dynamo.reset()
    counters.clear()
    # requires grad, as a layer's input does: then every block gets the same kind of input
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0)).requires_grad_()
    pending, results = [], []
    for n, seed in ((2, 1), (3, 2)):  # two chunks of different sizes, as with vpp
        ddp = DistributedDataParallel(config, _chunk(n, seed), grid=grid)
        buckets = [b for buffer in ddp.all_buffers for b in buffer.buckets]

        def spy(module, args, buckets=buckets):
            pending.append(any(b.param_handle is not None for b in buckets))

        ddp.module.register_forward_pre_hook(spy)  # eager, before the first compiled block
        want = ddp.module(x).detach()  # the params as built (start_param_sync gathers them)
        ddp.start_param_sync()  # async, as after an optimizer step
        results.append((ddp(x).detach(), want))
    return (
        pending,
        results,
        sum(counters["graph_break"].values()),
        counters["stats"]["unique_graphs"],
    )


def test_compiled_modules_read_gathered_params_without_graph_breaks(distributed):
    for pending, results, breaks, graphs in distributed.run(2, _forward_after_async_gather):
        assert pending == [False] * 4 and (breaks, graphs) == (0, 1)
        for got, want in results:
            torch.testing.assert_close(got, want, rtol=0, atol=0)
