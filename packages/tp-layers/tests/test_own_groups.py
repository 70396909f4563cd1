"""Layers on groups the user made (torch new_group, DeviceMesh), no pentatron grid at all.

Runs the package's example training loop at tp=2 (two tp groups on 4 ranks) and compares its
two losses with the same loop on a one-rank group: equal within fp32 rtol=1e-5.
"""

import importlib.util
from pathlib import Path

import torch
import torch.distributed as dist

from pentatron.parallel_state import model_parallel_is_initialized

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "mlp_own_groups.py"


def _example():
    spec = importlib.util.spec_from_file_location("mlp_own_groups", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _train_on_own_groups():
    example = _example()
    assert not model_parallel_is_initialized()
    tp_losses = example.check(example.tp_groups(2))  # the example's own checks, as torchrun runs
    solo_losses = example.train(example.tp_groups(1))
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    mesh_losses = example.train((mesh, "tp"))
    return tp_losses, solo_losses, mesh_losses, dist.get_rank()


def test_example_trains_on_torch_groups_and_device_mesh(distributed):
    for tp_losses, solo_losses, mesh_losses, _ in distributed.run(4, _train_on_own_groups):
        assert len(tp_losses) == 2 and tp_losses[1] < tp_losses[0]
        torch.testing.assert_close(tp_losses, solo_losses, rtol=1e-5, atol=0)
        torch.testing.assert_close(mesh_losses, solo_losses, rtol=1e-5, atol=0)
