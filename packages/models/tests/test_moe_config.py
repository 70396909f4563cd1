"""MoE settings that cannot work fail at construction with one line naming the field, the
rule and a fix: in `TransformerConfig` (config_checks) and against the grid
(`ModelParallel.check`)."""

from __future__ import annotations

import pytest

from pentatron.models import ModelConfigError, ModelParallel, TransformerConfig

BASE = dict(
    num_layers=2, hidden_size=32, num_attention_heads=4, num_moe_experts=8, moe_router_topk=2
)

CASES = [  # (overrides, the "field=value" the message must start with)
    (dict(expert_model_parallel_size=3), "num_moe_experts=8"),
    (dict(num_moe_experts=6, expert_model_parallel_size=4), "num_moe_experts=6"),
    (dict(moe_router_topk=9), "moe_router_topk=9"),
    (dict(moe_router_num_groups=3, moe_router_group_topk=1), "moe_router_num_groups=3"),
    (
        dict(moe_router_topk=4, moe_router_num_groups=2, moe_router_group_topk=3),
        "moe_router_group_topk=3",
    ),
    (  # one expert per group, two groups chosen: only 2 experts for top-4
        dict(moe_router_topk=4, moe_router_num_groups=8, moe_router_group_topk=2),
        "moe_router_topk=4",
    ),
    (dict(moe_router_num_groups=4), "moe_router_group_topk=None"),
    (dict(moe_ffn_hidden_size=10, expert_tensor_parallel_size=4), "moe_ffn_hidden_size=10"),
    (dict(moe_pad_expert_input_to_capacity=True), "moe_pad_expert_input_to_capacity=True"),
    (dict(num_moe_experts=None, expert_model_parallel_size=2), "expert_model_parallel_size=2"),
]


def _assert_clear(error: ModelConfigError, field: str) -> None:
    message = str(error)
    assert message.startswith(field), message
    assert "rule" in message and "fix" in message and "\n" not in message, message


@pytest.mark.parametrize("overrides, field", CASES, ids=[c[1] for c in CASES])
def test_bad_moe_config_names_field_rule_and_fix(overrides, field):
    with pytest.raises(ModelConfigError) as info:
        TransformerConfig(**{**BASE, **overrides})
    _assert_clear(info.value, field)


@pytest.mark.parametrize(
    "config_ep, config_etp, grid_ep, grid_etp, field",
    [
        (2, None, 1, 1, "expert_model_parallel_size=2"),
        (1, None, 4, 1, "expert_model_parallel_size=1"),
        (2, 2, 2, 1, "expert_tensor_parallel_size=2"),
    ],
)
def test_expert_sizes_must_match_the_grid(config_ep, config_etp, grid_ep, grid_etp, field):
    config = TransformerConfig(
        **BASE, expert_model_parallel_size=config_ep, expert_tensor_parallel_size=config_etp
    )
    grid_view = ModelParallel(None, None, 1, 0, 1, 0, None, None, 1, grid_ep, grid_etp)
    with pytest.raises(ModelConfigError) as info:
        grid_view.check(config)
    _assert_clear(info.value, field)


def test_a_valid_group_limited_config_builds():
    c = TransformerConfig(**BASE, moe_router_num_groups=4, moe_router_group_topk=2)
    assert (c.moe_router_num_groups, c.moe_router_group_topk) == (4, 2)
