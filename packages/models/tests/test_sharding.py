"""The sharding helper: its shards of the full (tp=1) model equal the live tp=2 model's
shards (same seed: tp-layers initialises the master weight, then splits), its merge is the
exact inverse, and a tied pipeline starts with identical first/last-stage copies.
Also: a config whose parallel sizes disagree with the grid fails before any collective."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from _gpt import VOCAB, S, small_config, with_layout

from pentatron.models import (
    GPTModel,
    ModelConfigError,
    get_gpt_layer_local_spec,
    global_param_name,
    local_param_name,
    merge_shards,
    param_sharding,
    shard_full_tensor,
)
from pentatron.parallel_state import (
    ParallelConfig,
    destroy_model_parallel,
    initialize_model_parallel,
)


def _full_model(config, divisible_by):
    torch.manual_seed(0)
    return GPTModel(
        config, get_gpt_layer_local_spec(), VOCAB, S, make_vocab_size_divisible_by=divisible_by
    )


def _live_shards_match(base, full):
    grid = initialize_model_parallel(ParallelConfig(tp=2))
    try:
        torch.manual_seed(0)
        model = GPTModel(
            with_layout(base, 2, 1, None, False),
            get_gpt_layer_local_spec(),
            VOCAB,
            S,
            grid=grid,
            make_vocab_size_divisible_by=64,
        )
        tp_rank = grid.rank("tp")
        mismatched = [
            name
            for name, p in model.state_dict().items()
            if not torch.equal(shard_full_tensor(name, full[name], tp_rank, 2, config=base), p)
        ]
        return {"names": sorted(model.state_dict()), "mismatched": mismatched}
    finally:
        destroy_model_parallel(grid)


def _tied_pipeline_start(base):
    grid = initialize_model_parallel(ParallelConfig(tp=2, pp=2))
    try:
        torch.manual_seed(grid.rank("pp"))  # different draws per stage: the all-reduce fixes it
        model = GPTModel(
            with_layout(base, 2, 2, None, False), get_gpt_layer_local_spec(), VOCAB, S, grid=grid
        )
        return grid.rank("pp"), grid.rank("tp"), model.shared_embedding_or_output_weight().detach()
    finally:
        destroy_model_parallel(grid)


def _mismatched_grid(base):
    errors = []
    grid = initialize_model_parallel(ParallelConfig(tp=2))
    try:
        GPTModel(base, get_gpt_layer_local_spec(), VOCAB, S, grid=grid)
    except ModelConfigError as exc:
        errors.append(str(exc))
    destroy_model_parallel(grid)
    try:
        GPTModel(base, get_gpt_layer_local_spec(), VOCAB, S)  # 4 processes, no grid
    except ModelConfigError as exc:
        errors.append(str(exc))
    return errors


def _world4_checks(base, full):
    return _live_shards_match(base, full), _tied_pipeline_start(base), _mismatched_grid(base)


@pytest.fixture(scope="module")
def world4(distributed):
    base = small_config()
    full = _full_model(base, 128).state_dict()
    return full, distributed.run(4, _world4_checks, base, full)


def test_helper_shards_equal_live_tp2_model(world4):
    full, results = world4
    for live, _, _ in results:
        assert live["mismatched"] == []
        assert live["names"] == sorted(full)


def test_tied_copies_equal_at_construction(world4):
    _, results = world4
    by_tp = {}
    for _, (pp_rank, tp_rank, weight), _ in results:
        by_tp.setdefault(tp_rank, {})[pp_rank] = weight
    for pair in by_tp.values():
        assert torch.equal(pair[0], pair[1])


def test_config_grid_mismatch_fails_before_collectives(world4):
    _, results = world4
    for _, _, errors in results:
        assert len(errors) == 2
        assert "tensor_model_parallel_size=1 but the grid has 2" in errors[0]
        assert "grid=None" in errors[1] and "fix:" in errors[1]


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
@pytest.mark.parametrize("tp", [2, 4])
def test_merge_is_inverse_of_shard(activation, tp):
    config = small_config(activation=activation)
    full = _full_model(config, 128).state_dict()
    for name, tensor in full.items():
        shards = [shard_full_tensor(name, tensor, r, tp, config=config) for r in range(tp)]
        assert torch.equal(merge_shards(name, shards, config=config), tensor), name


def test_swiglu_fc1_shard_is_gate_and_up_of_the_rank():
    config = small_config()
    ffn, h = config.ffn_hidden_size, config.hidden_size
    gate, up = torch.randn(ffn, h), torch.randn(ffn, h)
    shard = shard_full_tensor(
        "decoder.layers.0.mlp.linear_fc1.weight", torch.cat([gate, up]), 1, 2, config=config
    )
    assert torch.equal(shard, torch.cat([gate[ffn // 2 :], up[ffn // 2 :]]))


def test_vocab_padding_and_names():
    config = small_config()
    table = torch.randn(VOCAB, config.hidden_size)
    shard = shard_full_tensor(
        "embedding.word_embeddings.weight", table, 1, 2, config=config, padded_vocab_size=128
    )
    assert shard.shape == (64, config.hidden_size) and torch.equal(shard[: VOCAB - 64], table[64:])
    assert torch.count_nonzero(shard[VOCAB - 64 :]) == 0
    merged = merge_shards(
        "embedding.word_embeddings.weight", [table[:64], shard], config=config, vocab_size=VOCAB
    )
    assert torch.equal(merged, table)
    assert (
        global_param_name("decoder.layers.1.mlp.linear_fc2.weight", 2)
        == "decoder.layers.3.mlp.linear_fc2.weight"
    )
    assert (
        local_param_name("decoder.layers.3.input_layernorm.weight", 2)
        == "decoder.layers.1.input_layernorm.weight"
    )
    assert param_sharding("decoder.layers.0.self_attention.linear_proj.weight", config).dim == 1
    assert param_sharding("decoder.final_layernorm.weight", config).dim is None
    with pytest.raises(KeyError, match="not a GPT parameter"):
        param_sharding("decoder.layers.0.mystery.weight", config)
