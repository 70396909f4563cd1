"""`PipelineConfig.aux_loss_scale_func`: before every micro-batch's forward it receives the
factor the main loss gets before backward: 1/m, loss-scale/m with grad_scale_func, and 1
(or the loss scale) in per-token mode, as Megatron's forward_step sets the MoE aux scale."""

from __future__ import annotations

import pytest
import torch

from pentatron.pipeline import PipelineConfig, get_forward_backward_func

H = 4


class _Linear(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(H, 1, dtype=torch.float64)

    def set_input_tensor(self, tensors: list) -> None:
        self.input_tensor = tensors[0]


def _run(m: int, *, loss_scale: float | None, per_token: bool) -> tuple[list, list]:
    """Returns (scales received, event order) for one no-pipelining step of m micro-batches."""
    events: list[str] = []
    scales: list[float] = []

    def aux_scale(scale: torch.Tensor) -> None:
        assert scale.numel() == 1
        scales.append(float(scale.reshape(())))
        events.append("scale")

    def forward_step_func(data_iterator, model):
        events.append("forward")
        x = next(data_iterator)
        out = model.fc(x).sum()

        def loss_func(output):
            return (output, torch.tensor(3), output.detach()) if per_token else (output, output)

        return out, loss_func

    config = PipelineConfig(
        hidden_size=H,
        pipeline_dtype=torch.float64,
        calculate_per_token_loss=per_token,
        grad_scale_func=(lambda t: t * loss_scale) if loss_scale is not None else None,
        aux_loss_scale_func=aux_scale,
    )
    data = iter([torch.randn(2, H, dtype=torch.float64) for _ in range(m)])
    get_forward_backward_func(pp=1)(
        forward_step_func=forward_step_func,
        data_iterator=data,
        model=_Linear(),
        num_microbatches=m,
        config=config,
    )
    return scales, events


@pytest.mark.parametrize("m", [1, 3, 4])
@pytest.mark.parametrize(
    "loss_scale, per_token", [(None, False), (1024.0, False), (None, True), (8.0, True)]
)
def test_scale_per_microbatch(m: int, loss_scale: float | None, per_token: bool) -> None:
    scales, events = _run(m, loss_scale=loss_scale, per_token=per_token)
    expected = (loss_scale or 1.0) / (1 if per_token else m)
    assert scales == pytest.approx([expected] * m, rel=1e-6)  # fp32 ones(1)
    assert events == ["scale", "forward"] * m  # set before the model runs


def test_no_hook_no_call() -> None:
    config = PipelineConfig(hidden_size=H)
    assert config.aux_loss_scale_func is None
