"""Validation of mixture-of-experts fields and expert parallelism: each bad value, one message."""

from __future__ import annotations

import pytest

from pretrain.launcher.validate.recipe import validate
from tests.helpers import configure, problems

MOE = {"model.moe_experts": 8, "model.moe_top_k": 2, "cluster.gpus_per_node": 4}


def test_a_moe_recipe_with_ep_dividing_experts_and_dp_is_valid_for_launch() -> None:
    validate(configure({**MOE, "parallel.ep": 4}), for_launch=True)


def test_expert_tensor_parallelism_within_tp_beside_ep_is_valid_for_launch() -> None:
    validate(configure({**MOE, "parallel.ep": 2, "parallel.tp": 2, "parallel.etp": 2}), True)


@pytest.mark.parametrize(
    ("overrides", "field", "message"),
    [
        (
            {"parallel.ep": 3, "cluster.gpus_per_node": 6},
            "parallel.ep",
            "8 experts cannot be split evenly over 3",
        ),
        ({"parallel.ep": 8}, "parallel.ep", "dp=4 is not divisible by it"),
        ({"model.moe_top_k": 9}, "model.moe_top_k", "cannot pick more than the 8 experts"),
        ({"model.moe_top_k": 0}, "model.moe_top_k", "at least one expert"),
        ({"model.moe_capacity_factor": -1.0}, "model.moe_capacity_factor", "0 means dropless"),
        ({"model.moe_router": "relu"}, "model.moe_router", "unknown value 'relu'"),
        ({"model.moe_layers": "every:0"}, "model.moe_layers", "every:K needs 1 <= K"),
        ({"model.moe_layers": "after:40"}, "model.moe_layers", "leaves no MoE layer"),
        ({"model.moe_layers": "some"}, "model.moe_layers", "not a layer policy"),
        ({"model.moe_balance": "loss"}, "model.moe_balance", "unknown value 'loss'"),
        ({"model.moe_gemm": "bmm"}, "model.moe_gemm", "unknown value 'bmm'"),
        ({"parallel.etp": 2}, "parallel.etp", "tp=1 is not divisible by it"),
        (
            {"parallel.tp": 2, "parallel.etp": 2, "model.moe_ffn_dim": 33},
            "parallel.etp",
            "33 (model.moe_ffn_dim, or ffn_dim when 0) is not divisible by it",
        ),
        ({"parallel.etp": 0}, "parallel.etp", "must be >= 1"),
        (
            {"model.moe_balance": "bias", "model.moe_bias_rate": 0.0},
            "model.moe_bias_rate",
            "it never balances",
        ),
        ({"model.moe_route_scale": 0.0}, "model.moe_route_scale", "must be > 0"),
        ({"model.moe_shared_gate": True}, "model.moe_shared_gate", "this model has none"),
        ({"model.moe_groups": 3, "model.moe_node_limit": 1}, "model.moe_groups", "8 experts"),
        ({"model.moe_groups": 4}, "model.moe_groups", "model.moe_node_limit=0 keeps every"),
        ({"model.moe_groups": -1}, "model.moe_groups", "must be >= 0"),
        (
            {"model.moe_groups": 4, "model.moe_node_limit": 5},
            "model.moe_node_limit",
            "more than the model.moe_groups=4 groups",
        ),
        (
            {"model.moe_groups": 4, "model.moe_node_limit": 1, "model.moe_top_k": 3},
            "model.moe_node_limit",
            "1 group(s) of 2 experts each hold fewer than moe_top_k=3",
        ),
    ],
)
def test_bad_moe_value_is_refused_with_its_reason(overrides, field, message) -> None:
    found = [p for p in problems(configure({**MOE, **overrides})) if p.field == field]
    assert len(found) == 1
    assert message in found[0].reason


def test_expert_parallelism_of_a_dense_model_plans_but_does_not_launch() -> None:
    cfg = configure({"parallel.ep": 2, "cluster.gpus_per_node": 2})
    validate(cfg)
    found = [p for p in problems(cfg, for_launch=True) if p.field == "parallel.ep"]
    assert "needs a mixture-of-experts model" in found[0].reason


def test_expert_tensor_parallelism_of_a_dense_model_plans_but_does_not_launch() -> None:
    cfg = configure({"parallel.tp": 2, "parallel.etp": 2, "cluster.gpus_per_node": 2})
    validate(cfg)
    found = [p for p in problems(cfg, for_launch=True) if p.field == "parallel.etp"]
    assert "splits the experts of a mixture-of-experts model" in found[0].reason


def test_expert_parallelism_with_zero1_is_runnable() -> None:
    validate(configure({**MOE, "parallel.ep": 2, "parallel.zero": 1}), for_launch=True)


TWO_NODES = {**MOE, "cluster.nodes": 2, "parallel.ep": 8}


def test_a_node_limit_within_the_nodes_ep_spans_is_valid() -> None:
    validate(configure({**TWO_NODES, "model.moe_node_limit": 1}))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"model.moe_node_limit": -1}, "must be >= 0"),
        (
            {"model.moe_experts": 0, "parallel.ep": 1, "model.moe_node_limit": 1},
            "needs a mixture-of-experts model",
        ),
        (
            {"cluster.nodes": 1, "parallel.ep": 4, "model.moe_node_limit": 2},
            "fits in one node of 4 ranks, so a node limit is moot",
        ),
        ({"model.moe_node_limit": 3}, "spans 2 nodes of 4 ranks"),
        (
            {"model.moe_node_limit": 1, "model.moe_top_k": 5},
            "1 node(s) of 4 experts each hold fewer than moe_top_k=5",
        ),
        (
            {"cluster.gpus_per_node": 6, "parallel.ep": 4, "model.moe_node_limit": 1},
            "spreads the ep group unevenly over nodes of cluster.gpus_per_node=6",
        ),
    ],
)
def test_bad_node_limit_is_refused_with_its_reason(overrides, message) -> None:
    found = [
        p
        for p in problems(configure({**TWO_NODES, **overrides}))
        if p.field == "model.moe_node_limit"
    ]
    assert len(found) == 1
    assert message in found[0].reason


def test_the_models_own_expert_groups_need_no_layout_that_spans_nodes() -> None:
    """DeepSeek-V3's n_group / topk_group on one node: valid, and the router's groups."""
    from pretrain.core.layout import expert_node_groups

    cfg = configure({**MOE, "model.moe_groups": 4, "model.moe_node_limit": 2})
    validate(cfg, for_launch=True)
    assert expert_node_groups(cfg) == 4
