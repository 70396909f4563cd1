"""`DistributedOptimizer` (ZeRO-1): each dp rank owns 1/d of every bucket.

Per bucket of `n` elements, this rank owns `[start + r*n/d, start + (r+1)*n/d)`. The fp32
main params and the Adam state exist only for the pieces of params that fall in that range,
so optimizer memory is 12/d bytes per param (+ padding). Grads arrive there by the grad
buffer's reduce-scatter; after the step the updated shard is written into the param buffer
and `param[n/d]` -> all-gather(dp) -> `param[n]` refreshes the model (async and waited in
the next forward with `overlap_param_gather`).
"""

from __future__ import annotations

from .mixed_precision import MainParam, MixedPrecisionOptimizer, StepResult, _main_param


class DistributedOptimizer(MixedPrecisionOptimizer):
    is_sharded = True

    def _build_main_params(self) -> list[MainParam]:
        out = []
        for chunk in self.model_chunks:
            for buffer in chunk.all_buffers:
                if not buffer.sharded:
                    raise ValueError(
                        "DistributedOptimizer needs DDP buffers built with "
                        "DDPConfig(use_distributed_optimizer=True); fix: set it in the DDPConfig"
                    )
                param_data = buffer.param_data
                assert param_data is not None, "a sharded buffer keeps its params in param_data"
                for bucket in buffer.buckets:
                    size = bucket.numel // buffer.dp_size
                    lo = bucket.start + buffer.dp_rank * size
                    hi = lo + size
                    for p in bucket.params:
                        start, end = buffer.param_range[p]
                        a, b = max(start, lo), min(end, hi)
                        if a < b:
                            out.append(_main_param(p, buffer.grad_data[a:b], param_data[a:b]))
        return out

    def step(self) -> StepResult:
        result = super().step()
        if result.update_successful:
            for chunk in self.model_chunks:
                chunk.start_param_sync()
        return result
