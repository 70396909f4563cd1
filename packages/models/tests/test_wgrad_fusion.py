"""`TransformerConfig.gradient_accumulation_fusion` (Megatron's --no-gradient-accumulation-
fusion): with it on, the parallel linears add their weight grads straight into `main_grad`;
off, into `.grad` (the data-parallel wrapper adds `.grad` to `main_grad` later). Both give
the same gradient; the test can tell which path every linear took."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from _gpt import build_reference, microbatches, small_config

from pentatron.models import ModelConfigError, TransformerConfig
from pentatron.models.te_spec import fp8_recipe_kwargs
from pentatron.tp_layers import ColumnParallelLinear, RowParallelLinear


def _linears(model):
    return {
        n: m
        for n, m in model.named_modules()
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear)) and m.weight is not None
    }  # a tied output layer borrows the embedding's weight: autograd fills its .grad


def _grads(fusion: bool, config_kw: dict):
    torch.manual_seed(0)
    model = build_reference(small_config(gradient_accumulation_fusion=fusion, **config_kw))
    for p in model.parameters():  # what the DDP wrapper attaches
        p.main_grad = torch.zeros_like(p)
    ids, pos, labels = microbatches(1)[0]
    model(ids, pos, labels=labels).mean().backward()
    return model


@pytest.mark.parametrize(
    "config_kw", [{}, {"untie_embeddings_and_output_weights": True}], ids=["tied", "untied"]
)
def test_weight_grads_go_to_main_grad_only_when_fused(config_kw):
    fused, unfused = _grads(True, config_kw), _grads(False, config_kw)
    lin_f, lin_u = _linears(fused), _linears(unfused)
    # qkv, proj, fc1, fc2 per layer (+ the untied output layer)
    assert len(lin_u) == 4 * 4 + bool(config_kw)
    for name, layer in lin_u.items():
        assert layer.gradient_accumulation_fusion is False, name
        assert lin_f[name].gradient_accumulation_fusion is True, name
        w_f, w_u = lin_f[name].weight, layer.weight
        assert w_f.grad is None and w_f.main_grad.abs().sum() > 0, name
        assert w_u.grad is not None and w_u.main_grad.abs().sum() == 0, name
        # the same sum of products, one added to zeros: fp32, rounding only
        torch.testing.assert_close(w_u.grad, w_f.main_grad, rtol=1e-6, atol=1e-7)


def test_fp8_recipe_knobs_are_validated_and_passed():
    config = small_config(fp8_amax_history_len=1024, fp8_amax_compute_algo="max", fp8_margin=1)
    assert fp8_recipe_kwargs(config) == {
        "margin": 1,
        "amax_history_len": 1024,
        "amax_compute_algo": "max",
    }
    for field, bad in [
        ("fp8_amax_history_len", 0),
        ("fp8_amax_compute_algo", "mean"),
        ("fp8_margin", -1),
    ]:
        with pytest.raises(ModelConfigError, match=field):
            small_config(**{field: bad})
    assert TransformerConfig.__dataclass_fields__["fp8_amax_history_len"].default == 1
