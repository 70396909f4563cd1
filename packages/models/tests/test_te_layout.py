"""The TE spec's layout in PyTorch (`get_gpt_layer_te_spec(backend="torch")`), one process.

The layout fuses each dense layer's two norms into the linears after them
(`linear_qkv.layer_norm_weight`, `linear_fc1.layer_norm_weight`, as Megatron's TE spec).
It must: compute exactly what the local spec computes from the same weights (torch.equal
on losses and every gradient, matched by `global_param_name`); load the local spec's state
dict and be loaded by it; convert to and from Hugging Face like the local spec; keep a
real norm before a MoE layer; and refuse FP8 and unknown backends by name. The fused
layout's tp/pp/SP parity is in test_parity.py; the TE modules run in
tools/device_checks/models_te.py.
"""

import dataclasses
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from _gpt import small_config

from pentatron.models import (
    GPTModel,
    ModelConfigError,
    get_gpt_layer_local_spec,
    get_gpt_layer_te_spec,
    global_param_name,
)
from pentatron.models.norm import RMSNorm

V, S = 64, 16


def _te_layout():
    return get_gpt_layer_te_spec(backend="torch")


def _build(spec, config, seed):
    torch.manual_seed(seed)
    return GPTModel(config, spec, vocab_size=V, max_sequence_length=S)


def _batch():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, V, (2, S), generator=g)
    return ids, torch.arange(S).expand(2, S), torch.randint(0, V, (2, S), generator=g)


def _loss_and_grads(model):
    ids, pos, labels = _batch()
    loss = model(ids, pos, labels=labels)
    loss.mean().backward()
    grads = {global_param_name(n, 0): p.grad for n, p in model.named_parameters()}
    return loss.detach(), grads


@pytest.mark.parametrize("normalization", ["RMSNorm", "LayerNorm"])
def test_same_numbers_as_the_local_spec_from_the_same_weights(normalization):
    config = small_config(normalization=normalization)
    local = _build(get_gpt_layer_local_spec(), config, 1)
    fused = _build(_te_layout(), config, 2)  # other init: every tensor must be loaded
    fused.load_state_dict(local.state_dict())
    names = [n for n, _ in fused.named_parameters() if "layer_norm_" in n]
    kinds = ("weight", "bias") if normalization == "LayerNorm" else ("weight",)
    assert len(names) == 2 * config.num_layers * len(kinds)
    assert not any("input_layernorm" in n or "pre_mlp_layernorm" in n for n in fused.state_dict())
    want_loss, want = _loss_and_grads(local)
    got_loss, got = _loss_and_grads(fused)
    assert torch.equal(got_loss, want_loss)
    assert sorted(got) == sorted(want)
    for name, grad in want.items():
        assert torch.equal(got[name], grad), name


def test_local_spec_loads_the_fused_layout_state_dict():
    config = small_config(normalization="LayerNorm")
    fused = _build(_te_layout(), config, 3)
    with torch.no_grad():  # norms away from their init, so a skipped load shows
        for n, p in fused.named_parameters():
            if "layer_norm_" in n:
                p.normal_()
    local = _build(get_gpt_layer_local_spec(), config, 4)
    local.load_state_dict(fused.state_dict())
    mine = {global_param_name(n, 0): t for n, t in fused.state_dict().items()}
    assert sorted(mine) == sorted(local.state_dict())
    for name, tensor in local.state_dict().items():
        assert torch.equal(tensor, mine[name]), name


def test_missing_norm_keys_are_still_reported():
    config = small_config()
    local = _build(get_gpt_layer_local_spec(), config, 1)
    state = local.state_dict()
    del state["decoder.layers.1.pre_mlp_layernorm.weight"]
    result = _build(_te_layout(), config, 2).load_state_dict(state, strict=False)
    assert result.missing_keys == ["decoder.layers.1.mlp.linear_fc1.layer_norm_weight"]
    assert result.unexpected_keys == []


def test_hugging_face_conversion_is_shared_with_the_local_spec():
    pytest.importorskip("transformers")
    from test_hf_convert import llama

    from pentatron.models.hf import from_hf, to_hf

    hf = llama(num_key_value_heads=2, tie_word_embeddings=False)
    ours = from_hf(hf, spec=_te_layout()).eval()
    assert any("linear_qkv.layer_norm_weight" in n for n, _ in ours.named_parameters())
    ids = torch.randint(0, 100, (2, 24), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(24).expand(2, 24)
    with torch.no_grad():
        got = ours(ids, pos)[..., :100]  # the padded vocabulary's extra rows dropped
        torch.testing.assert_close(got, hf(ids).logits, atol=1e-4, rtol=1e-4)
    back = to_hf(ours)
    assert sorted(back) == sorted(hf.state_dict())
    for name, tensor in hf.state_dict().items():
        assert torch.equal(back[name], tensor), name


def test_moe_layers_keep_their_own_norm():
    config = small_config(
        num_layers=2,
        num_moe_experts=4,
        moe_router_topk=2,
        moe_ffn_hidden_size=16,
        moe_layer_freq=[0, 1],
    )
    fused = _build(_te_layout(), config, 5)
    dense, moe = fused.decoder.layers
    assert isinstance(dense.pre_mlp_layernorm, torch.nn.Identity)
    assert hasattr(dense.mlp.linear_fc1, "layer_norm_weight")
    assert isinstance(moe.pre_mlp_layernorm, RMSNorm)
    local = _build(get_gpt_layer_local_spec(), config, 6)
    local.load_state_dict(fused.state_dict())
    ids, pos, _ = _batch()
    with torch.no_grad():
        assert torch.equal(fused(ids, pos), local(ids, pos))


def test_fp8_and_unknown_backends_are_refused_by_name():
    fp8 = dataclasses.replace(small_config(), fp8="hybrid")
    for spec in (get_gpt_layer_local_spec(), _te_layout()):
        with pytest.raises(ModelConfigError, match=r"fp8='hybrid'.*get_gpt_layer_te_spec"):
            _build(spec, fp8, 1)
    with pytest.raises(ModelConfigError, match="backend='apex'"):
        get_gpt_layer_te_spec(backend="apex")
