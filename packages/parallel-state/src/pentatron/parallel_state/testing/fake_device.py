"""A fake accelerator for CPU-only tests: run the real code on `meta` with a fake world.

    with fake_world(rank=3, world_size=8), FakeDevice(compute_dtype=torch.bfloat16) as dev:
        ...  # initialize_model_parallel(...), build the model, run a training step
    dev.reads, dev.gemms   # what happened

`fake_world` starts torch's fake process group as rank `rank` of `world_size` with the
"meta:fake" backend: compute groups take `meta` tensors only and reject a CPU tensor with
NCCL's very error ("No backend type associated with device type cpu"); the grid's `host`
group ("cpu:fake") takes CPU tensors only. Nothing is communicated and nothing computed, so
one process plays any rank of any layout in seconds, whatever the model size.

`FakeDevice` is a dispatch mode that holds the code to the rules of a real GPU, which
`meta` alone would not (meta kernels accept a CPU index tensor, say):
- a device op may not take a host tensor (other than a 0-d scalar, which CUDA accepts
  too); copies between host and device (`copy_`, `.to`) are the only way across;
- with `compute_dtype` bf16/fp16, no GEMM of model size (every side >= `min_gemm_side`) may
  run on fp32 operands (what an fp32 weight-gradient GEMM looks like: CUDA cores, not
  tensor cores);
- attention runs as CUDA's fused SDPA kernels would (flash for bf16/fp16, memory-efficient
  otherwise); where CUDA would fall back to SDPA's math kernel (fp32 with grouped k/v,
  say: quadratic memory, no tensor cores) it is a violation;
- reading device memory from the host (`.item()`, `.tolist()`, `.cpu()`, and the output
  size of `masked_select` / `nonzero`) returns zeros (a fake device has no data; 0 means
  "finite, nothing found, no token routed" to the code that asks) and is counted in
  `reads`, so a test can bound the host syncs of a step.
A violation raises `DeviceDisciplineError` at the op, with its name and the tensors' devices.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

aten = torch.ops.aten

FAKE_BACKEND = "meta:fake"


class DeviceDisciplineError(AssertionError):
    """Code did something on the fake device that would fail, or be slow, on a GPU."""


def _register_fake_backend() -> None:
    try:  # torch's own registration (a testing module, present in every build we support)
        import torch.testing._internal.distributed.fake_pg  # noqa: F401
    except ImportError:  # pragma: no cover - a build without torch.testing
        if "FAKE" in getattr(dist.Backend, "_plugins", {}):
            return
        from torch._C._distributed_c10d import FakeProcessGroup

        def create(common_opts: Any, backend_opts: Any) -> Any:
            # torch's stub lacks the options argument that torch's own fake_pg.py passes
            return FakeProcessGroup._create_internal(  # type: ignore[call-arg]
                common_opts.group_rank, common_opts.group_size, backend_opts
            )

        dist.Backend.register_backend("fake", create, extended_api=True, devices=["cpu", "meta"])


@contextlib.contextmanager
def fake_world(rank: int, world_size: int) -> Iterator[None]:
    """The default process group as rank `rank` of a fake world of `world_size`."""
    if dist.is_initialized():
        raise RuntimeError("fake_world: a process group already exists in this process")
    _register_fake_backend()
    dist.init_process_group(FAKE_BACKEND, store=dist.HashStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        from ..grid import destroy_model_parallel

        destroy_model_parallel()
        dist.destroy_process_group()


def _gemm_ops() -> dict[Any, tuple[int, int]]:
    """Every GEMM overload -> the positions of its two matrix operands."""
    out: dict[Any, tuple[int, int]] = {}
    for name, operands in (("mm", (0, 1)), ("bmm", (0, 1)), ("addmm", (1, 2)), ("baddbmm", (1, 2))):
        for packet_name in (name, name + "_"):
            packet = getattr(aten, packet_name, None)
            if packet is None:
                continue
            for overload in packet.overloads():
                out[getattr(packet, overload)] = operands
    if hasattr(aten, "_grouped_mm"):
        out[aten._grouped_mm.default] = (0, 1)
    return out


_GEMMS = _gemm_ops()
_TRANSFERS = {
    aten.copy_.default,
    aten._to_copy.default,
    aten.to.dtype_layout,
    aten._copy_from.default,
}
_READS = {aten._local_scalar_dense.default, aten.is_nonzero.default}
# Ops whose output size depends on the data (meta has no kernel for them): under the rule
# that device memory reads as zeros, a mask selects nothing.
_DATA_SIZED = {aten.masked_select.default, aten.nonzero.default}


@dataclass
class GemmRecord:
    op: str
    dtypes: tuple[torch.dtype, ...]
    shapes: tuple[tuple[int, ...], ...]


def cuda_sdpa_kernel(
    query: torch.Tensor,
    key: torch.Tensor,
    attn_mask: Any,
    enable_gqa: bool,
    value: torch.Tensor | None = None,
) -> str:
    """The SDPA kernel CUDA runs (sm80+): flash for bf16/fp16 without a mask and q, k, v
    heads of one size, at most 256 dims (grouped k/v included), else memory-efficient
    (which takes a value head size of its own, as MLA's), which does not take grouped k/v:
    those fall back to the math kernel."""
    d = query.size(-1)
    grouped = enable_gqa and key.size(-3) != query.size(-3)
    same_dims = value is None or value.size(-1) == d
    low = query.dtype in (torch.bfloat16, torch.float16)
    if low and attn_mask is None and d <= 256 and same_dims:
        return "flash"
    return "math" if grouped else "efficient"


class _FusedKernels(TorchFunctionMode):
    """Runs `F.scaled_dot_product_attention` on the fake device as one fused kernel (meta
    has none: SDPA would decompose into its math ops there, unlike on a GPU)."""

    def __init__(self, device: FakeDevice) -> None:
        super().__init__()
        self.device = device

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is not torch.nn.functional.scaled_dot_product_attention:
            return func(*args, **kwargs)
        q, k, v = args[:3]
        if q.device.type != self.device.device_type:
            return func(*args, **kwargs)
        return self.device.sdpa(q, k, v, **kwargs)


class FakeDevice(TorchDispatchMode):
    """See the module docstring. The GEMM rule covers GEMMs whose every side (M, N, K) is at
    least `min_gemm_side`: a router's `[T, h] x [h, E]` over a few experts stays below it
    (its fp32 gating is deliberate, Megatron's `--moe-router-dtype fp32`)."""

    def __init__(
        self,
        compute_dtype: torch.dtype = torch.float32,
        device_type: str = "meta",
        min_gemm_side: int = 16,
    ) -> None:
        super().__init__()
        self.compute_dtype, self.device_type = compute_dtype, device_type
        self.min_gemm_side = min_gemm_side
        self.reads: list[str] = []
        """Host reads of device memory, one entry each (op name)."""
        self.gemms: list[GemmRecord] = []
        self.sdpa_kernels: list[str] = []
        """The SDPA kernel each attention call took (see `cuda_sdpa_kernel`)."""
        self._functions = _FusedKernels(self)

    def __enter__(self) -> FakeDevice:
        self._functions.__enter__()
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self._functions.__exit__(*exc)

    def sdpa(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attn_mask: Any = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        kernel = cuda_sdpa_kernel(q, k, attn_mask, enable_gqa, v)
        self.sdpa_kernels.append(kernel)
        if kernel == "math":
            raise DeviceDisciplineError(
                f"scaled_dot_product_attention: {q.dtype} with grouped k/v "
                f"({q.size(-3)} query heads, {k.size(-3)} k/v heads"
                f"{', a mask' if attn_mask is not None else ''}) has no fused CUDA kernel and "
                "would run SDPA's math kernel (quadratic memory, no tensor cores); fix: repeat "
                "k/v to the query heads first (pentatron.models.sdpa.grouped_sdpa decides)"
            )
        if kernel == "flash":
            return aten._scaled_dot_product_flash_attention(
                q, k, v, dropout_p, is_causal, False, scale=scale
            )[0]
        return aten._scaled_dot_product_efficient_attention(
            q, k, v, attn_mask, True, dropout_p, is_causal, scale=scale
        )[0]

    # --- the rules -----------------------------------------------------------------------
    def _check_devices(self, func: Any, tensors: list[torch.Tensor]) -> None:
        on_device = [t for t in tensors if t.device.type == self.device_type]
        on_host = [t for t in tensors if t.device.type == "cpu" and t.dim() > 0]
        if on_device and on_host:
            shapes = ", ".join(f"cpu{tuple(t.shape)}:{t.dtype}" for t in on_host)
            raise DeviceDisciplineError(
                f"{func}: host tensor(s) {shapes} in an op on {self.device_type} tensors; "
                "on a GPU this fails or hides a host-to-device copy; create the tensor on "
                "the grid's device (pentatron.parallel_state.current_device())"
            )

    def _check_gemm(self, func: Any, args: Any, tensors: list[torch.Tensor]) -> None:
        operands = [args[i] for i in _GEMMS[func]]
        self.gemms.append(
            GemmRecord(
                str(func), tuple(t.dtype for t in operands), tuple(tuple(t.shape) for t in operands)
            )
        )
        if self.compute_dtype not in (torch.bfloat16, torch.float16):
            return
        a, b = operands
        m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
        big = min(m, k, n) >= self.min_gemm_side
        if big and any(t.dtype == torch.float32 for t in operands):
            raise DeviceDisciplineError(
                f"{func}: an fp32 GEMM ({', '.join(f'{tuple(t.shape)}:{t.dtype}' for t in operands)}) "
                f"in a {self.compute_dtype} model; on a GPU it runs on CUDA cores, not tensor "
                "cores; fix: multiply in the compute dtype and accumulate in fp32 (out_dtype)"
            )

    # --- dispatch ------------------------------------------------------------------------
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        tensors = [t for t in flat if isinstance(t, torch.Tensor)]
        src = tensors[0] if tensors else None
        if func in _READS and src is not None and src.device.type == self.device_type:
            self.reads.append(str(func))
            return False if src.dtype == torch.bool else 0
        if func in _TRANSFERS:
            return self._transfer(func, args, kwargs, tensors)
        if func in _DATA_SIZED and src is not None and src.device.type == self.device_type:
            self._check_devices(func, tensors)
            self.reads.append(str(func))  # a GPU reads the output size on the host too
            if func is aten.nonzero.default:
                return src.new_empty((0, src.dim()), dtype=torch.long)
            return src.new_empty((0,))
        self._check_devices(func, tensors)
        if func in _GEMMS:
            self._check_gemm(func, args, tensors)
        return func(*args, **kwargs)

    def _transfer(self, func: Any, args: Any, kwargs: dict, tensors: list[torch.Tensor]) -> Any:
        if func is aten.copy_.default:
            dst, src = args[0], args[1]
            if dst.device.type == "cpu" and src.device.type == self.device_type:
                self.reads.append("copy_ to host")
                return dst.zero_()
            return func(*args, **kwargs)
        src = tensors[0]
        target = kwargs.get("device")
        if (
            src.device.type == self.device_type
            and target is not None
            and torch.device(target).type == "cpu"
        ):
            self.reads.append(f"{func} to host")
            dtype = kwargs.get("dtype") or src.dtype
            return torch.zeros(src.shape, dtype=dtype, device="cpu")
        return func(*args, **kwargs)


__all__ = ["FAKE_BACKEND", "DeviceDisciplineError", "FakeDevice", "GemmRecord", "fake_world"]
