"""The mixture-of-experts block: routing, dispatch/combine, losses, capacity, counts, the
grouped GEMM against the loop, and balancing by bias."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from pretrain import models
from pretrain.core.model_config import MOE_BALANCES, ModelConfig
from pretrain.core.schema import RecomputeConfig
from pretrain.models.flops import count_params, flops_per_token
from pretrain.models.init import init_weights
from pretrain.models.moe import (
    Grouped,
    GroupedExperts,
    MoEFeedForward,
    keep_mask,
    load_balancing_loss,
    moe_modules,
    router_losses,
)
from pretrain.parallel.expert import SlotBound, finish_routing_step
from pretrain.parallel.recompute import apply_recompute

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

    def identity(grouped: Grouped) -> torch.Tensor:
        seen.append(grouped.counts.clone())
        return grouped.rows

    block.dispatch = identity
    x = torch.randn(3, 5, H)
    out = block(x)
    experts, weights, _, _ = block.route(x)
    # Every token comes back once per slot, scaled by that slot's router weight (summed in
    # expert order, so equal up to FP32 rounding).
    torch.testing.assert_close(out, x * weights.sum(-1, keepdim=True), rtol=1e-6, atol=1e-6)
    assert torch.equal(seen[0], torch.bincount(experts.flatten(), minlength=N))


def test_normalized_top_k_weights_make_the_round_trip_exact() -> None:
    block = MoEFeedForward(moe_config())
    nn.init.normal_(block.router.weight)
    block.dispatch = lambda grouped: grouped.rows
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
    block.dispatch = lambda grouped: grouped.rows
    x = torch.randn(1, 8, H)
    experts, weights, _, _ = block.route(x)
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


def test_a_gated_shared_expert_counts_its_gate_weights_and_flops() -> None:
    cfg = moe_config(moe_shared_experts=1, moe_shared_gate=True)
    model = models.build(cfg)
    assert count_params(cfg).total == sum(p.numel() for p in model.parameters())
    ungated = flops_per_token(moe_config(moe_shared_experts=1), 16).mlp
    assert flops_per_token(cfg, 16).mlp == ungated + cfg.n_moe_layers * 2 * H


def test_the_route_scale_weighs_the_routed_experts_and_the_gate_the_shared_ones() -> None:
    """Identity experts: the output is route_scale x the input, plus sigmoid(gate) x the
    shared expert's (DeepSeek's routed_scaling_factor, Qwen2-MoE's shared_expert_gate)."""
    torch.manual_seed(0)
    block = MoEFeedForward(
        moe_config(moe_route_scale=2.5, moe_shared_experts=1, moe_shared_gate=True)
    )
    for param in block.parameters():
        nn.init.normal_(param, std=0.3)
    block.dispatch = lambda grouped: grouped.rows
    x = torch.randn(3, 5, H)
    gate = torch.sigmoid(x @ block.shared_gate.weight.T)
    expected = 2.5 * x + gate * block.shared(x)
    torch.testing.assert_close(block(x), expected)


def test_flops_follow_active_experts_and_the_router() -> None:
    dense = flops_per_token(moe_config(moe_experts=0), 16)
    moe = flops_per_token(moe_config(moe_shared_experts=1), 16)
    per_layer = 2 * H * N + (K + 1) * 3 * 2 * H * 12
    assert moe.mlp == 2 * per_layer
    assert moe.attention_projections == dense.attention_projections


# --- grouped GEMM, host syncs, recompute, balancing ------------------------------------

HARNESS_MOE = dict(dim=64, moe_experts=8, moe_top_k=2, moe_ffn_dim=64)
"""The harness model's expert shapes (tests/distributed): 8 experts of width 64, top-2."""


def test_grouped_gemm_matches_the_loop_in_fp32_with_uneven_and_empty_groups() -> None:
    torch.manual_seed(0)
    sizes = [5, 0, 17, 3, 0, 9, 30, 1]
    x = torch.randn(sum(sizes), 64)
    ends = torch.tensor(sizes).cumsum(0)
    grouped, loop = GroupedExperts(8, 64, 64, "grouped"), GroupedExperts(8, 64, 64, "loop")
    for name in ("w1", "w2", "w3"):
        weight = torch.randn(getattr(grouped, name).shape) * 0.1
        getattr(grouped, name).data.copy_(weight)
        getattr(loop, name).data.copy_(weight)
    assert grouped.uses_grouped_mm(x) and not loop.uses_grouped_mm(x)
    results = []
    for experts in (grouped, loop):
        inputs = x.clone().requires_grad_()
        out = experts(inputs, ends)
        out.backward(torch.ones_like(out))
        results.append([out, inputs.grad, experts.w1.grad, experts.w2.grad, experts.w3.grad])
    for ours, reference in zip(*results, strict=True):
        torch.testing.assert_close(ours, reference, rtol=0, atol=1e-6)


@pytest.mark.parametrize("capacity_factor", [0.0, 1.0])
def test_moe_block_is_the_same_function_with_grouped_gemm_and_the_loop(capacity_factor) -> None:
    blocks = []
    for gemm in ("grouped", "loop"):
        cfg = moe_config(**HARNESS_MOE, moe_gemm=gemm, moe_capacity_factor=capacity_factor)
        model = models.build(cfg)
        init_weights(model, seed=3)
        blocks.append(model)
    tokens = torch.randint(0, 64, (4, 32), generator=torch.Generator().manual_seed(1))
    outputs = []
    for model in blocks:
        loss = model(tokens).square().mean() + router_losses(model)
        loss.backward()
        outputs.append([loss, *(p.grad for p in model.parameters())])
    for ours, reference in zip(*outputs, strict=True):
        torch.testing.assert_close(ours, reference, rtol=1e-6, atol=1e-6)
    if capacity_factor:
        assert blocks[0].layers["0"].feed_forward.stats.totals[8] > 0  # some were dropped


def test_the_grouped_path_reads_nothing_back_to_the_host() -> None:
    # On the meta device any value read on the host (.item(), .tolist(), bincount's max,
    # masked indexing) raises: forward and backward must not need one.
    cfg = moe_config(**HARNESS_MOE, moe_capacity_factor=1.0, moe_balance="both")
    block = MoEFeedForward(cfg).to(device="meta", dtype=torch.bfloat16)
    x = torch.empty(2, 16, 64, device="meta", dtype=torch.bfloat16, requires_grad=True)
    out = block(x)
    assert block.experts.uses_grouped_mm(out.reshape(-1, 64))
    (out.sum() + block.aux_loss).backward()
    assert x.grad.shape == x.shape


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_routing_is_counted_once_per_forward_under_recompute(policy) -> None:
    cfg = moe_config(**HARNESS_MOE)
    model = models.build(cfg)
    init_weights(model, seed=0)
    apply_recompute(model, RecomputeConfig(policy=policy))
    model(torch.randint(0, 64, (2, 16))).sum().backward()
    for block in moe_modules(model):
        assert block.stats.forwards == 1
        assert block.stats.totals[:8].sum().item() == 2 * 16 * 2  # tokens x k, not twice


def skewed_block(rate: float) -> tuple[MoEFeedForward, torch.Tensor]:
    """A bias-balanced block (sigmoid scores, as DeepSeek-V3) whose router sends almost every
    token to expert 0, and its inputs: 4 sequences of 64 tokens."""
    torch.manual_seed(0)
    cfg = moe_config(**HARNESS_MOE, moe_router="sigmoid", moe_balance="bias", moe_bias_rate=rate)
    block = MoEFeedForward(cfg)
    nn.init.normal_(block.router.weight, std=0.2)
    direction = torch.randn(64)
    direction /= direction.norm()
    block.router.weight.data[0] += 4 * direction
    block.reset_bias()
    return block, torch.randn(4, 64, 64) + direction


def imbalance(block: MoEFeedForward) -> float:
    """Max over mean assignments per expert of the block's last step."""
    load = block.step_load()
    return (load.max() / load.mean()).item()


def test_the_balancing_bias_evens_out_a_skewed_router_within_thirty_steps() -> None:
    block, x = skewed_block(rate=0.01)
    history = []
    for _ in range(60):
        with torch.no_grad():
            block(x)
        history.append(imbalance(block))
        finish_routing_step(block, group=None)
    assert history[0] > 3.0  # expert 0 takes almost every token's first slot
    # Measured: below 1.3 from step 15 on, 1.13 at most over the last 20 steps.
    assert max(history[30:]) < 1.3
    # Only the choice moved: expert 0 is still the router's favourite by score.
    assert block.expert_bias[0] == block.expert_bias.min() < 0


def test_the_bias_picks_experts_but_the_weights_stay_the_router_scores() -> None:
    cfg = moe_config(moe_balance="bias", moe_normalize_topk=False)
    block = MoEFeedForward(cfg)
    nn.init.normal_(block.router.weight)
    block.reset_bias()
    block.expert_bias[3] = 10.0
    x = torch.randn(2, 5, H)
    experts, weights, _, logits = block.route(x)
    assert (experts == 3).any(-1).all()
    torch.testing.assert_close(weights, logits.softmax(-1).gather(-1, experts))


def test_balance_by_bias_trains_no_balance_loss_and_both_trains_it() -> None:
    x = torch.randn(2, 6, H)
    aux = {}
    for balance in ("aux", "bias", "both"):
        torch.manual_seed(0)
        block = MoEFeedForward(moe_config(moe_balance=balance, moe_z_loss_coef=0.0))
        block.reset_bias()
        block(x)
        aux[balance] = block.aux_loss.item()
    assert aux["bias"] == 0.0
    assert aux["both"] == pytest.approx(aux["aux"]) and aux["aux"] > 0


def test_only_bias_balanced_models_carry_the_bias_in_their_state() -> None:
    keys = {b: models.build(moe_config(moe_balance=b)).state_dict().keys() for b in MOE_BALANCES}
    assert "layers.0.feed_forward.expert_bias" in keys["bias"] & keys["both"]
    assert not any("expert_bias" in k for k in keys["aux"])


def test_a_rerun_step_takes_its_routing_counts_back() -> None:
    cfg = moe_config(**HARNESS_MOE)
    block = MoEFeedForward(cfg)
    x = torch.randn(2, 8, 64)
    block(x)
    finish_routing_step(block, group=None)
    kept = block.stats.totals.clone()
    block(x)
    block.stats.drop_step()
    assert torch.equal(block.stats.totals, kept) and block.stats.forwards == 1


def test_dropless_slots_grow_past_an_overflow_and_shrink_when_twice_too_large() -> None:
    bound = SlotBound(layer=0)
    assert bound.rows(assignments=64, experts=8) == 16  # 2x the mean of 8, aligned to 8
    assert bound.settle(largest=12) is False and bound.rows(64, 8) == 16
    assert bound.settle(largest=30) is True  # overflowed: the step runs again
    assert bound.rows(64, 8) == 40  # 30 with 25% headroom, aligned
    assert bound.settle(largest=9) is False and bound.rows(64, 8) == 16


@pytest.mark.parametrize("capacity_factor", [0.0, 1.0])
def test_slotted_dispatch_matches_the_local_experts_rerunning_past_an_overflow(
    single_rank_group, capacity_factor
) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from pretrain.parallel.expert import AllToAllDispatch, settle_slot_bounds

    cfg = moe_config(**HARNESS_MOE, moe_capacity_factor=capacity_factor)
    local, slotted = models.build(cfg), models.build(cfg)
    init_weights(local, seed=1)
    init_weights(slotted, seed=1)
    mesh = init_device_mesh("cpu", (1,))
    for key, block in slotted.layers.items():
        block.feed_forward.dispatch = AllToAllDispatch(block.feed_forward.experts, mesh, int(key))
        block.feed_forward.dispatch.bound.factor = 0.25  # far below the load: overflows
    tokens = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(0))

    def run(model: nn.Module) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        loss = model(tokens).square().mean()
        loss.backward()
        return [loss, *(p.grad for p in model.parameters())]

    expected = run(local)
    first = run(slotted)
    # With a capacity the slots hold every kept row by construction; dropless they learn.
    assert settle_slot_bounds(slotted, cfg.n_layers, torch.device("cpu")) == (not capacity_factor)
    rerun = run(slotted)
    assert not settle_slot_bounds(slotted, cfg.n_layers, torch.device("cpu"))
    for ours, reference in zip(rerun, expected, strict=True):
        torch.testing.assert_close(ours, reference, rtol=1e-6, atol=1e-6)
    if not capacity_factor:
        assert not torch.allclose(first[0], expected[0], rtol=1e-6)  # dropped in overflow
