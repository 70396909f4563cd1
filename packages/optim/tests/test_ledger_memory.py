"""Wire bytes of the distributed optimizer vs all-reduce DDP, bucket layout, and memory."""

import torch

from pentatron.optim import DDPConfig, DistributedDataParallel, OptimizerConfig, get_optimizer
from pentatron.parallel_state import ParallelConfig, comm, initialize_model_parallel


def model_128(dtype):
    """Param sizes multiples of 128: no padding, so bytes per param are exact."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 128), torch.nn.Linear(128, 128), torch.nn.Linear(128, 32, bias=False)
    ).to(dtype)


def step_ledger(dist_opt, bucket_size):
    grid = initialize_model_parallel(ParallelConfig())
    ddp = DistributedDataParallel(
        DDPConfig(
            overlap_grad_reduce=True,
            bucket_size=bucket_size,
            use_distributed_optimizer=dist_opt,
            grad_reduce_in_fp32=True,
        ),
        model_128(torch.float32),
        grid=grid,
    )
    opt = get_optimizer(
        OptimizerConfig(use_distributed_optimizer=dist_opt, clip_grad=0.0), [ddp], grid=grid
    )
    with comm.trace() as ledger:
        ddp(torch.randn(4, 32)).sum().backward()
        ddp.finish_grad_sync()
        opt.step()
        ddp.finish_param_sync()
    dp = [r for r in ledger.records if r.group == "dp-cp" and r.elements > 1]
    scalars = [(r.op, r.group) for r in ledger.records if r.elements == 1]
    return {
        "ops": [(r.op, r.elements, r.wire_bytes) for r in dp],
        "scalars": scalars,
        "buckets": [b.numel for b in ddp.dense_buffers[0].buckets],
    }


def _ledger_case(bucket_size):
    return step_ledger(False, bucket_size), step_ledger(True, bucket_size)


def test_distributed_optimizer_moves_the_bytes_of_an_all_reduce(distributed):
    numels = [32 * 128, 128, 128 * 128, 128, 128 * 32]  # module order; buffers run reversed
    bucket_size = 4000
    for ddp, zero in distributed.run(4, _ledger_case, bucket_size):
        # buckets close once >= bucket_size elements: reversed order 4096 | 128+16384 | 128+4096
        assert ddp["buckets"] == [4096, 128 + 16384, 128 + 4096]
        assert zero["buckets"] == ddp["buckets"]  # all multiples of lcm(4, 128): no padding
        assert [op for op, _, _ in ddp["ops"]] == ["all_reduce"] * 3
        assert [op for op, _, _ in zero["ops"]] == ["reduce_scatter"] * 3 + ["all_gather"] * 3
        assert sum(n for _, n, _ in ddp["ops"]) == sum(numels)
        ar = sum(w for _, _, w in ddp["ops"])
        assert ar == 2 * 3 / 4 * sum(numels) * 4  # 2(d-1)/d of the fp32 bytes
        assert sum(w for _, _, w in zero["ops"]) == ar
        # besides: the grad-norm partial sums (1 element), over dp-cp only when sharded
        assert ddp["scalars"] == [("all_reduce", "tp-pp")]
        assert zero["scalars"] == [("all_reduce", "tp-pp"), ("all_reduce", "dp-cp")]


def memory_per_param(dist_opt):
    grid = initialize_model_parallel(ParallelConfig())
    ddp = DistributedDataParallel(
        DDPConfig(use_distributed_optimizer=dist_opt, grad_reduce_in_fp32=True),
        model_128(torch.bfloat16),
        grid=grid,
    )
    opt = get_optimizer(
        OptimizerConfig(bf16=True, use_distributed_optimizer=dist_opt), [ddp], grid=grid
    )
    ddp(torch.randn(4, 32, dtype=torch.bfloat16)).float().sum().backward()
    ddp.finish_grad_sync()
    opt.step()
    n = sum(p.numel() for p in ddp.parameters())
    storages = {}

    def hold(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()

    for p in ddp.parameters():
        hold(p.data)
    for b in ddp.dense_buffers:
        hold(b.grad_data)
    big_state = small_state = 0
    for mp in opt.main_params:
        hold(mp.main)
    for state in opt.optimizer.state.values():
        for t in state.values():
            if torch.is_tensor(t) and t.numel() > 1:
                hold(t)
            elif torch.is_tensor(t):
                small_state += t.untyped_storage().nbytes()
    big_state = sum(storages.values())
    grad_bytes = sum(b.grad_data.untyped_storage().nbytes() for b in ddp.dense_buffers)
    return big_state / n, grad_bytes / n, small_state, len(opt.main_params)


def test_memory_bytes_per_param(distributed):
    d = 4
    plain = distributed.run(d, memory_per_param, False)
    zero = distributed.run(d, memory_per_param, True)
    for per_param, grad, small, count in plain:
        assert per_param == 18 and grad == 4  # 2 bf16 + 4 grad + 4 main + 8 Adam
        assert small <= 8 * count  # Adam's scalar step counters only
    for per_param, grad, _, _ in zero:
        assert per_param == 6 + 12 / d and grad == 4


def test_sharded_layout_pads_params_and_buckets():
    from pentatron.optim import plan_layout

    lay = plan_layout([100, 30, 5000, 7], bucket_size=120, dp_size=3, pad_for_sharding=True)
    # params start on 64-element boundaries, buckets end on multiples of lcm(3, 128) = 384
    # bucket 0 = params 0, 1 (158 >= 120 elements), bucket 1 = param 2, bucket 2 = param 3
    assert lay.param_ranges == ((0, 100), (128, 158), (384, 5384), (5760, 5767))
    assert lay.bucket_ranges == ((0, 384), (384, 5760), (5760, 6144))
    plain = plan_layout([100, 30, 5000, 7], bucket_size=120, dp_size=3, pad_for_sharding=False)
    assert plain.bucket_ranges == ((0, 130), (130, 5130), (5130, 5137))


def module_buffers_and_grad_buffers():
    grid = initialize_model_parallel(ParallelConfig())
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    ddp = DistributedDataParallel(DDPConfig(), model, grid=grid)
    return (
        [name for name, _ in ddp.named_buffers()],
        [tuple(b.shape) for b in ddp.buffers()],  # nn.Module's, not hidden by the grad buffers
        [b.grad_data.numel() for b in ddp.dense_buffers],
    )


def test_grad_buffers_leave_module_buffers_alone(distributed):
    names = ["module.1.running_mean", "module.1.running_var", "module.1.num_batches_tracked"]
    for named, shapes, numels in distributed.run(2, module_buffers_and_grad_buffers):
        assert named == names
        assert shapes == [(4,), (4,), ()]
        assert sum(numels) >= 4 * 4 + 4 + 4 + 4  # Linear weight, bias, BatchNorm weight, bias
