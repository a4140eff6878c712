"""Node-limited routing (model.moe_node_limit): each token's experts come from at most M
node groups, the full limit is plain top-k, the gradient reaches only the kept scores, the
trainer's groups follow the recipe's layout and the plan counts the nodes a token reaches."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pretrain.core.layout import ep_nodes, expert_node_groups, resolve_degrees
from pretrain.core.model_config import ModelConfig
from pretrain.core.schema import RecipeConfig
from pretrain.launcher.validate.recipe import validate
from pretrain.models.moe import (
    Grouped,
    MoEFeedForward,
    moe_modules,
    node_limited,
    set_node_groups,
)
from tests.helpers import configure

N, H = 16, 8


def block(limit: int, groups: int, k: int = 4, **overrides: object) -> MoEFeedForward:
    cfg = ModelConfig(
        vocab_size=64, dim=H, n_heads=2, ffn_dim=16, n_layers=1, moe_experts=N,
        moe_top_k=k, moe_ffn_dim=12, moe_node_limit=limit, **overrides,
    )  # fmt: skip
    moe = MoEFeedForward(cfg)
    set_node_groups(moe, groups)
    return moe


def nodes_reached(experts: torch.Tensor, groups: int) -> torch.Tensor:
    """Distinct node groups among each token's experts [b, s]."""
    node = experts // (N // groups)
    hit = torch.zeros(*experts.shape[:-1], groups, dtype=torch.bool)
    return hit.scatter_(-1, node, True).sum(-1)


@pytest.mark.parametrize(("groups", "limit"), [(4, 1), (4, 2), (2, 1), (8, 3)])
def test_each_token_is_dispatched_to_at_most_m_nodes(groups: int, limit: int) -> None:
    torch.manual_seed(groups * 10 + limit)
    limited, plain = block(limit, groups), block(0, groups)
    nn.init.normal_(limited.router.weight)
    plain.router.weight.data.copy_(limited.router.weight)
    x = torch.randn(4, 64, H)
    reached = nodes_reached(limited.route(x)[0], groups)
    assert reached.max().item() == limit  # never more, and the limit is used
    # Unlimited top-4 of random scores spans more nodes, so the limit is what bounds it.
    assert nodes_reached(plain.route(x)[0], groups).max().item() > limit
    # What the forward hands the dispatch is that routing: its counts per node match.
    seen: list[torch.Tensor] = []

    def identity(grouped: Grouped) -> torch.Tensor:
        seen.append(grouped.counts)
        return grouped.rows

    limited.dispatch = identity
    limited(x)
    node = limited.route(x)[0] // (N // groups)
    want = torch.bincount(node.flatten(), minlength=groups)
    assert torch.equal(seen[0].view(groups, -1).sum(-1), want)


@pytest.mark.parametrize("balance", ["aux", "bias"])
def test_a_limit_of_every_node_routes_as_plain_top_k(balance: str) -> None:
    torch.manual_seed(1)
    limited, plain = block(4, 4, moe_balance=balance), block(0, 4, moe_balance=balance)
    nn.init.normal_(limited.router.weight)
    plain.router.weight.data.copy_(limited.router.weight)
    if balance == "bias":
        limited.expert_bias.normal_(std=0.1)
        plain.expert_bias.copy_(limited.expert_bias)
    x = torch.randn(2, 32, H)
    for got, want in zip(limited.route(x), plain.route(x), strict=True):
        assert torch.equal(got, want)
    # A limit above the groups (one process of a layout validation refuses) keeps them all.
    set_node_groups(limited, 1)
    assert torch.equal(limited.route(x)[0], plain.route(x)[0])


def test_the_router_gradient_flows_only_through_the_kept_scores() -> None:
    torch.manual_seed(2)
    moe = block(1, 4, moe_router="sigmoid", moe_normalize_topk=False)
    nn.init.normal_(moe.router.weight)
    experts, weights, _, logits = moe.route(torch.randn(2, 16, H))
    logits.retain_grad()
    (weights * torch.rand_like(weights).add(0.5)).sum().backward()
    kept = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, experts, True)
    assert logits.grad is not None
    assert torch.all(logits.grad[~kept] == 0)
    assert torch.all(logits.grad[kept] != 0)


def test_two_nodes_of_two_experts_keep_the_node_with_the_best_pair() -> None:
    # Node 0 holds experts 0, 1; node 1 holds 2, 3. Plain top-2 takes 2 and 0 (both nodes);
    # node 1's pair sums to 0.66 against node 0's 0.34, so one node gives 2 and 3.
    scores = torch.tensor([[0.32, 0.02, 0.36, 0.30]])
    assert scores.topk(2).indices.tolist() == [[2, 0]]
    limited = node_limited(scores, groups=2, limit=1)
    assert limited.topk(2).indices.tolist() == [[2, 3]]
    assert limited[0, :2].tolist() == [float("-inf")] * 2


@pytest.mark.parametrize(
    ("ep", "tp", "gpus_per_node", "nodes"),
    [(16, 1, 8, 2), (8, 1, 8, 1), (4, 2, 8, 1), (8, 2, 8, 2), (4, 8, 8, 4), (4, 16, 8, 4),
     (6, 1, 8, None), (2, 3, 8, None), (3, 1, 8, None)],
)  # fmt: skip
def test_ep_nodes_follows_the_rank_layout(ep, tp, gpus_per_node, nodes) -> None:
    assert ep_nodes(ep, tp, gpus_per_node) == nodes


def test_the_trainer_groups_come_from_the_recipe() -> None:
    cfg = configure(
        {"model.moe_experts": 16, "model.moe_top_k": 2, "model.moe_node_limit": 1,
         "cluster.nodes": 4, "cluster.gpus_per_node": 4, "parallel.ep": 8}
    )  # fmt: skip
    assert expert_node_groups(cfg) == 2
    cfg.model.moe_node_limit = 0
    assert expert_node_groups(cfg) == 1


def test_the_plan_shows_the_nodes_a_token_reaches() -> None:
    from pretrain.launcher.plan.plan import make_plan
    from pretrain.launcher.plan.report.render import render_plan

    cfg = configure(
        {"model.moe_experts": 8, "model.moe_top_k": 2, "model.moe_node_limit": 1,
         "cluster.nodes": 2, "cluster.gpus_per_node": 4, "parallel.ep": 8}
    )  # fmt: skip
    text = render_plan(make_plan(cfg))
    assert "EP all-to-all per MoE layer per micro-batch (one rank)" in text
    assert "at most 1" in text


def test_an_ep_rank_the_trainer_builds_routes_over_the_recipes_groups() -> None:
    """One rank of an ep=8 job over 2 nodes of 4, built by the trainer under fake tensors and
    collectives: its MoE layers route over 2 node groups."""
    from pretrain.parallel.mesh import build_mesh
    from pretrain.trainer.build import build_model
    from pretrain.trainer.dryrun.fake import fake_tensors, fake_world

    cfg = RecipeConfig(name="node_limit")
    cfg.model = ModelConfig(
        vocab_size=512, dim=32, n_layers=1, n_heads=2, ffn_dim=64, max_seq_len=32,
        moe_experts=8, moe_top_k=2, moe_node_limit=1,
    )  # fmt: skip
    cfg.train.seq_len, cfg.train.micro_batch, cfg.train.global_batch = 32, 1, 8
    cfg.parallel.ep, cfg.cluster.nodes, cfg.cluster.gpus_per_node = 8, 2, 4
    cfg.cluster.device, cfg.cluster.gpu_type = "cpu", "cpu"
    validate(cfg)
    with fake_world(5, 8):
        mesh = build_mesh(resolve_degrees(cfg), "cpu")
        with fake_tensors():
            _, plain = build_model(cfg, mesh, torch.device("cpu"))
    assert [m.node_groups for m in moe_modules(plain)] == [2]


def test_the_plan_warns_that_a_limit_inside_one_node_is_moot() -> None:
    from pretrain.launcher.plan.plan import make_plan

    one_node = {"model.moe_experts": 8, "model.moe_node_limit": 1, "cluster.gpus_per_node": 4}
    warnings = make_plan(configure({**one_node, "parallel.ep": 4})).warnings
    assert any("model.moe_node_limit=1 is moot" in w for w in warnings)
    spanning = {**one_node, "cluster.nodes": 2, "parallel.ep": 8}
    assert not any("moot" in w for w in make_plan(configure(spanning)).warnings)


def test_the_models_own_groups_route_without_a_layout_and_bound_the_nodes_reached() -> None:
    """model.moe_groups (DeepSeek-V3's n_group): a block routes over them as built, with no
    recipe layout; the plan's bound on the nodes a token reaches follows where groups lie."""
    from pretrain.launcher.plan.comm.ep import ep_communication

    moe = MoEFeedForward(
        ModelConfig(
            vocab_size=64, dim=H, n_heads=2, ffn_dim=16, n_layers=1, moe_experts=N,
            moe_top_k=4, moe_ffn_dim=12, moe_node_limit=1, moe_groups=4,
        )
    )  # fmt: skip
    nn.init.normal_(moe.router.weight)
    assert moe.node_groups == 4
    assert nodes_reached(moe.route(torch.randn(2, 32, H))[0], 4).max().item() == 1
    shape = {"model.moe_experts": 16, "model.moe_top_k": 8, "model.moe_node_limit": 2,
             "cluster.nodes": 4, "cluster.gpus_per_node": 4, "parallel.ep": 16}  # fmt: skip
    reach = {
        groups: ep_communication(cfg, resolve_degrees(cfg)).nodes_per_token
        for groups in (8, 2, 16)
        for cfg in [configure({**shape, "model.moe_groups": groups})]
    }
    # 8 or 16 groups lie two or four to a node: 2 groups, 2 nodes; 2 groups span 2 nodes each.
    assert reach == {8: 2, 2: 4, 16: 2}
