"""The memory model follows the optimizer-state dtype, Muon's split, ZeRO-sharded experts and
the experts' own split over tp (none, or etp)."""

from __future__ import annotations

import pytest

from pretrain.core.layout import resolve_degrees
from pretrain.core.optim_states import state_bytes
from pretrain.launcher.plan.memory import memory_breakdown, moe_tp_replicated, tp_replicated
from pretrain.models.flops import count_params
from tests.helpers import configure

MOE = {"model.moe_experts": 8, "model.moe_ffn_dim": 512, "model.moe_top_k": 2}


def breakdown(overrides: dict):
    cfg = configure(overrides)
    return memory_breakdown(cfg, resolve_degrees(cfg), microbatches=1)


@pytest.mark.parametrize("dtype", ["bf16", "int8", "int4"])
def test_optimizer_bytes_scale_with_the_state_dtype(dtype) -> None:
    fp32 = breakdown({"parallel.zero": 3}).optimizer
    ours = breakdown({"parallel.zero": 3, "optim.state_dtype": dtype}).optimizer
    assert ours / fp32 == pytest.approx(state_bytes(dtype) / 4)


def test_muon_keeps_one_state_on_the_blocks_matrices_and_two_elsewhere() -> None:
    cfg = configure({"optim.name": "muon"})
    counts = count_params(cfg.model)
    m = cfg.model
    vectors = 2 * m.dim * m.n_layers + m.dim
    others = counts.embedding + counts.lm_head + vectors
    expected = 4 * (1 * (counts.total - others) + 2 * others)
    assert breakdown({"optim.name": "muon"}).optimizer == pytest.approx(expected)


def test_zero3_shards_experts_over_the_ranks_holding_the_same_ones() -> None:
    # 8 ranks, ep=2: each rank holds 4 experts, shared with 3 other ranks (dp / ep = 4).
    ddp = breakdown({**MOE, "parallel.ep": 2, "parallel.zero": 0})
    zero3 = breakdown({**MOE, "parallel.ep": 2, "parallel.zero": 3})
    cfg = configure(MOE)
    experts = count_params(cfg.model).experts
    dense = count_params(cfg.model).total - experts
    rope = ddp.params - 4 * (dense + experts / 2)
    assert zero3.params - rope == pytest.approx(4 * (dense / 8 + experts / 2 / 4))


def test_tp_leaves_a_moe_layer_whole_and_etp_splits_its_routed_experts() -> None:
    """Under tp = 2 a MoE layer (router, shared and routed experts) stays whole on each rank
    while the rest of the block splits; etp = 2 then halves the routed experts."""
    shape = {**MOE, "model.moe_shared_experts": 1, "parallel.ep": 2}
    cfg = configure(shape)
    m, counts = cfg.model, count_params(cfg.model)
    tp1 = breakdown(shape).params
    tp2 = breakdown({**shape, "parallel.tp": 2}).params
    etp2 = breakdown({**shape, "parallel.tp": 2, "parallel.etp": 2}).params
    whole = tp_replicated(m) * m.n_layers + m.dim + moe_tp_replicated(m) * m.n_moe_layers
    routed = 4 * counts.experts / 2  # ep = 2
    assert tp2 == pytest.approx((tp1 - 4 * whole - routed) / 2 + 4 * whole + routed, rel=1e-3)
    assert tp2 - etp2 == pytest.approx(routed / 2)


def test_mla_keeps_its_latent_down_projections_whole_under_tp() -> None:
    cfg = configure({"model.attention": "mla", "model.n_kv_heads": 0})
    m = cfg.model
    assert tp_replicated(m) == 2 * m.dim + m.dim * (m.kv_rank + m.rope_dim) + m.kv_rank
    tp1 = breakdown({"model.attention": "mla", "model.n_kv_heads": 0}).params
    tp2 = breakdown({"model.attention": "mla", "model.n_kv_heads": 0, "parallel.tp": 2}).params
    replicated = tp_replicated(m) * m.n_layers + m.dim
    assert tp2 == pytest.approx((tp1 - 4 * replicated) / 2 + 4 * replicated, rel=1e-3)


def test_key_value_weights_fewer_heads_than_tp_are_counted_whole_on_every_rank() -> None:
    """Llama 3 70B at TP 16: its 8 KV heads are replicated (parallel/tensor.py), so each
    rank holds both 1024 x 8192 matrices besides its norms; at TP 8 they split."""
    from tests.helpers import LLAMA3_70B

    assert tp_replicated(LLAMA3_70B, 8) == 2 * 8192
    assert tp_replicated(LLAMA3_70B, 16) == 2 * 8192 + 2 * 1024 * 8192
