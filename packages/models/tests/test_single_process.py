"""One-process behaviour: outputs, loss vs torch cross-entropy, masks, specs, RoPE."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))

from _gpt import VOCAB, S, build_reference, microbatches, small_config

from pentatron.models import MLP, ModuleSpec, apply_rotary_pos_emb, get_gpt_layer_local_spec
from pentatron.models.rope import RotaryEmbedding


def test_loss_is_cross_entropy_of_the_logits():
    model = build_reference(small_config())
    ids, pos, labels = microbatches(1)[0]
    logits = model(ids, pos)
    assert logits.shape == (ids.size(0), S, model.padded_vocab_size)
    want = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
    torch.testing.assert_close(
        model(ids, pos, labels=labels), want.view_as(labels), rtol=1e-5, atol=1e-6
    )


def test_explicit_causal_mask_equals_default():
    model = build_reference(small_config())
    ids, pos, _ = microbatches(1)[0]
    mask = torch.ones(S, S, dtype=torch.bool).triu(1)[None, None]
    torch.testing.assert_close(model(ids, pos, attention_mask=mask), model(ids, pos))


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(
            normalization="LayerNorm", activation="gelu", position_embedding_type="learned_absolute"
        ),
    ],
)
def test_state_dict_names_are_megatrons(kw):
    names = set(build_reference(small_config(**kw)).state_dict())
    assert "embedding.word_embeddings.weight" in names and "output_layer.weight" not in names
    assert "decoder.layers.3.self_attention.linear_qkv.weight" in names
    assert "decoder.final_layernorm.weight" in names
    assert ("embedding.position_embeddings.weight" in names) == bool(kw)


def test_spec_swaps_the_mlp_class():
    class TracingMLP(MLP):
        calls = 0

        def forward(self, x):
            TracingMLP.calls += 1
            return super().forward(x)

    spec = get_gpt_layer_local_spec()
    spec.submodules.mlp.module = TracingMLP
    model = build_reference(small_config())
    torch.manual_seed(0)
    from pentatron.models import GPTModel

    swapped = GPTModel(small_config(), spec, VOCAB, S, make_vocab_size_divisible_by=32)
    ids, pos, _ = microbatches(1)[0]
    swapped.load_state_dict(model.state_dict())
    torch.testing.assert_close(swapped(ids, pos), model(ids, pos))
    assert TracingMLP.calls == 4 and isinstance(spec, ModuleSpec)


def test_rope_scores_depend_on_relative_position_only():
    config = small_config(rotary_percent=0.5)
    rope = RotaryEmbedding(config)
    q, k = torch.randn(1, 1, 1, config.kv_channels), torch.randn(1, 1, 1, config.kv_channels)

    def score(m, n):
        cq, sq = rope(torch.tensor([[m]]), 1)
        ck, sk = rope(torch.tensor([[n]]), 1)
        return (apply_rotary_pos_emb(q, cq, sq) * apply_rotary_pos_emb(k, ck, sk)).sum()

    torch.testing.assert_close(score(5, 2), score(13, 10))
    cos, sin = rope(torch.tensor([[3]]), 1)
    out = apply_rotary_pos_emb(q, cos, sin)
    assert torch.equal(out[..., config.rotary_dim :], q[..., config.rotary_dim :])


def _stream_dtypes(fp32_residual: bool):
    """bf16 params: the dtypes of what flows between layers (each layer's input and output,
    the final norm's input: the residual stream) and into the layers' linears; the loss."""
    model = build_reference(
        small_config(params_dtype=torch.bfloat16, fp32_residual_connection=fp32_residual)
    )
    seen: dict[str, set] = {"stream": set(), "linear": set()}

    def record(kind, and_output=False):
        def hook(module, args, output):
            seen[kind].add(args[0].dtype)
            if and_output:
                seen[kind].add(output.dtype)

        return hook

    for layer in model.decoder.layers:
        layer.register_forward_hook(record("stream", and_output=True))
        for linear in (layer.self_attention.linear_qkv, layer.mlp.linear_fc1):
            linear.register_forward_hook(record("linear"))
    model.decoder.final_layernorm.register_forward_hook(record("stream"))
    ids, pos, labels = microbatches(1)[0]
    assert model(ids, pos).dtype == torch.bfloat16
    loss = model(ids, pos, labels=labels)
    assert loss.dtype == torch.float32 and torch.isfinite(loss).all()
    return seen, loss


def test_bf16_params_and_fp32_residual():
    """With fp32_residual_connection the residual stream (embedding output, every layer's
    input and output, the final norm's input) is fp32 while the norms hand the linears bf16;
    without it the stream is bf16, and the losses differ."""
    on, loss_on = _stream_dtypes(True)
    assert on == {"stream": {torch.float32}, "linear": {torch.bfloat16}}
    off, loss_off = _stream_dtypes(False)
    assert off == {"stream": {torch.bfloat16}, "linear": {torch.bfloat16}}
    assert not torch.equal(loss_on, loss_off)  # the fp32 adds round differently
