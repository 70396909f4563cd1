"""The linear-backend switch: "auto" falls back to the PyTorch layers without TE + CUDA,
"te" fails with the install hint, the environment variable is honoured, and unknown
values are rejected. (The TE layers themselves run only where TE and a GPU exist; the
device check script exercises them there.)"""

import pytest
import torch

from pentatron.tp_layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    column_parallel_linear,
    linear_backend,
    row_parallel_linear,
    te_available,
)
from pentatron.tp_layers.utils import TPConfigError


def _group():
    import torch.distributed as dist

    return dist.new_group([dist.get_rank()])


def _build(backend):
    group = _group()
    torch.manual_seed(0)
    col = column_parallel_linear(8, 16, tp_group=group, bias=True, backend=backend)
    row = row_parallel_linear(16, 8, tp_group=group, input_is_parallel=True, backend=backend)
    torch.manual_seed(0)
    ref_col = ColumnParallelLinear(8, 16, tp_group=group, bias=True)
    x = torch.randn(4, 2, 8)
    same = torch.equal(col.weight, ref_col.weight)
    out, bias = row(col(x)[0])
    return type(col).__name__, type(row).__name__, same, tuple(out.shape), bias


@pytest.mark.skipif(te_available(), reason="the fallback is what this machine can check")
def test_auto_falls_back_to_the_pytorch_layers(distributed):
    col, row, same, shape, bias = distributed.run(1, _build, "auto")[0]
    assert (col, row) == (ColumnParallelLinear.__name__, RowParallelLinear.__name__)
    assert same and shape == (4, 2, 8) and bias is None


@pytest.mark.skipif(te_available(), reason="TE is usable here")
def test_te_without_te_or_cuda_is_a_clear_error():
    with pytest.raises(TPConfigError, match="pentatron-tp-layers\\[te\\]"):
        linear_backend("te")


def test_environment_variable_and_bad_values(monkeypatch):
    monkeypatch.setenv("PENTATRON_LINEAR_BACKEND", "torch")
    assert linear_backend() == "torch"
    monkeypatch.setenv("PENTATRON_LINEAR_BACKEND", "cutlass")
    with pytest.raises(TPConfigError, match="'cutlass'"):
        linear_backend()
