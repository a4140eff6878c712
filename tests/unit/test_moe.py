"""The mixture-of-experts block: routing, dispatch/combine, losses, capacity and counts."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import models
from models.flops import count_params, flops_per_token
from models.init import init_weights
from models.moe import MoEFeedForward, keep_mask, load_balancing_loss, router_losses
from pretrain_core.model_config import ModelConfig

N, K, H = 4, 2, 8


def moe_config(**overrides) -> ModelConfig:
    fields = dict(
        vocab_size=64,
        dim=H,
        n_heads=2,
        ffn_dim=16,
        n_layers=2,
        moe_experts=N,
        moe_top_k=K,
        moe_ffn_dim=12,
    )
    return ModelConfig(**{**fields, **overrides})


def test_identity_experts_give_back_the_input_weighted_by_the_router() -> None:
    torch.manual_seed(0)
    block = MoEFeedForward(moe_config(moe_normalize_topk=False))
    nn.init.normal_(block.router.weight)
    seen = []

    def identity(x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        seen.append(counts.clone())
        return x

    block.dispatch = identity
    x = torch.randn(3, 5, H)
    out = block(x)
    experts, weights, _ = block.route(x)
    # Every token comes back once per slot, scaled by that slot's router weight (summed in
    # expert order, so equal up to FP32 rounding).
    torch.testing.assert_close(out, x * weights.sum(-1, keepdim=True), rtol=1e-6, atol=1e-6)
    assert torch.equal(seen[0], torch.bincount(experts.flatten(), minlength=N))


def test_normalized_top_k_weights_make_the_round_trip_exact() -> None:
    block = MoEFeedForward(moe_config())
    nn.init.normal_(block.router.weight)
    block.dispatch = lambda x, counts: x
    x = torch.randn(2, 6, H)
    torch.testing.assert_close(block(x), x, rtol=1e-6, atol=1e-6)


def test_load_balancing_loss_matches_its_formula_on_a_hand_made_routing() -> None:
    # One sequence of 2 tokens, top-2 of 4: assignments go to experts 0, 1, 0, 2.
    experts = torch.tensor([[[0, 1], [0, 2]]])
    scores = torch.tensor([[[0.4, 0.3, 0.2, 0.1], [0.5, 0.1, 0.3, 0.1]]])
    fraction = [2 / 4, 1 / 4, 1 / 4, 0.0]
    probability = [0.45, 0.2, 0.25, 0.1]
    expected = N * sum(f * p for f, p in zip(fraction, probability, strict=True))
    assert load_balancing_loss(scores, experts, N).item() == pytest.approx(expected)


def test_uniform_routing_has_a_balance_loss_of_one() -> None:
    experts = torch.tensor([[[0, 1], [2, 3]]])
    scores = torch.full((1, 2, N), 1 / N)
    assert load_balancing_loss(scores, experts, N).item() == pytest.approx(1.0)


def test_capacity_keeps_the_first_assignments_of_each_expert_per_sequence() -> None:
    # Two sequences; capacity 2. Sequence 0 sends expert 0 three assignments: the third, at
    # (position 2, slot 0), drops. Sequence 1 counts from zero again.
    experts = torch.tensor([[[0, 1], [0, 2], [0, 3]], [[0, 1], [1, 2], [3, 0]]])
    keep = keep_mask(experts, N, limit=2)
    expected = torch.tensor(
        [[[True, True], [True, True], [False, True]], [[True, True], [True, True], [True, True]]]
    )
    assert torch.equal(keep, expected)
    assert keep_mask(experts, N, limit=None).all()


def test_dropped_assignments_contribute_nothing_and_are_counted() -> None:
    cfg = moe_config(moe_capacity_factor=0.5, moe_normalize_topk=False)
    block = MoEFeedForward(cfg)
    nn.init.normal_(block.router.weight)
    block.dispatch = lambda x, counts: x
    x = torch.randn(1, 8, H)
    experts, weights, _ = block.route(x)
    limit = math.ceil(0.5 * 8 * K / N)
    keep = keep_mask(experts, N, limit)
    assert not keep.all()
    out = block(x)
    assert torch.allclose(out, x * (weights * keep).sum(-1, keepdim=True), atol=1e-6)
    dropped = block.stats.totals[N].item()
    assert dropped == (~keep).sum().item()


def test_router_losses_weight_balance_and_z_loss_by_their_coefficients() -> None:
    cfg = moe_config(moe_aux_loss_coef=0.5, moe_z_loss_coef=0.25, n_layers=1)
    model = models.build(cfg)
    init_weights(model, seed=0)
    model(torch.randint(0, 64, (2, 4)))
    block = model.layers["0"].feed_forward
    balance, z = block.stats.totals[N + 1], block.stats.totals[N + 2]
    assert router_losses(model).item() == pytest.approx((0.5 * balance + 0.25 * z).item())


def test_moe_layers_policy_picks_the_layers() -> None:
    assert [moe_config(n_layers=4).is_moe_layer(i) for i in range(4)] == [True] * 4
    every = moe_config(n_layers=4, moe_layers="every:2")
    assert [every.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
    after = moe_config(n_layers=4, moe_layers="after:1")
    assert [after.is_moe_layer(i) for i in range(4)] == [False, True, True, True]


def test_parameter_counts_match_the_module_and_active_counts_k_plus_shared_experts() -> None:
    cfg = moe_config(moe_shared_experts=1, moe_layers="after:1")
    model = models.build(cfg)
    counts = count_params(cfg)
    assert counts.total == sum(p.numel() for p in model.parameters())
    expert = 3 * H * cfg.expert_ffn_dim
    assert counts.total - counts.active == cfg.n_moe_layers * (N - K) * expert
    assert counts.experts == cfg.n_moe_layers * N * expert


def test_flops_follow_active_experts_and_the_router() -> None:
    dense = flops_per_token(moe_config(moe_experts=0), 16)
    moe = flops_per_token(moe_config(moe_shared_experts=1), 16)
    per_layer = 2 * H * N + (K + 1) * 3 * 2 * H * 12
    assert moe.mlp == 2 * per_layer
    assert moe.attention_projections == dense.attention_projections
