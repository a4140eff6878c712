"""Distributed Muon's work split: who orthogonalizes which matrix, the slices the owner joins,
and the plan's account of the FLOPs it saves and the bytes it moves."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pretrain import models
from pretrain.core.layout import resolve_degrees
from pretrain.core.optim_states import assign_owners, busiest_load, newton_schulz_flops
from pretrain.launcher.plan.muon_work import block_matrices, expert_matrices, muon_work
from pretrain.trainer.optim.distributed_muon import chunk_sizes
from pretrain.trainer.optim.optimizers import param_groups
from tests.helpers import configure


def test_every_matrix_gets_one_owner_and_the_busiest_rank_at_most_the_mean_plus_one() -> None:
    costs = [float(c) for c in [9, 1, 7, 7, 3, 3, 3, 2, 8, 1, 5]]
    owners = assign_owners(costs, 4)
    assert len(owners) == len(costs) and set(owners) == {0, 1, 2, 3}
    loads = [sum(c for c, o in zip(costs, owners, strict=True) if o == r) for r in range(4)]
    assert max(loads) <= sum(costs) / 4 + max(costs)
    assert max(loads) == busiest_load(costs, 4)
    assert assign_owners(costs, 4) == owners  # the same on every rank


def test_equal_matrices_go_round_robin_and_more_ranks_than_matrices_leave_some_idle() -> None:
    assert assign_owners([1.0] * 6, 3) == [0, 1, 2, 0, 1, 2]
    assert assign_owners([4.0, 2.0], 4) == [0, 1]
    assert assign_owners([5.0, 5.0], 1) == [0, 0]
    with pytest.raises(ValueError, match="ranks=0"):
        assign_owners([1.0], 0)


def test_newton_schulz_flops_count_the_small_side_squared() -> None:
    # 5 iterations of X X^T (2 a^2 b), its square (2 a^3) and the product with X (2 a^2 b).
    assert (
        newton_schulz_flops(64, 128)
        == newton_schulz_flops(128, 64)
        == 5 * (4 * 64 * 64 * 128 + 2 * 64**3)
    )


@pytest.mark.parametrize(("size", "parts"), [(14, 4), (5, 4), (3, 8), (128, 2), (0, 3)])
def test_chunk_sizes_are_torch_chunks_padded_with_empty_ones(size: int, parts: int) -> None:
    lengths = [len(c) for c in torch.arange(size).chunk(parts)] if size else []
    assert chunk_sizes(size, parts) == lengths + [0] * (parts - len(lengths))


@pytest.mark.parametrize(
    "model",
    [
        {"moe_experts": 4, "moe_shared_experts": 1, "moe_layers": "after:1", "moe_ffn_dim": 32},
        {"attention": "mla", "mla_q_rank": 16, "n_kv_heads": 0, "mlp": "gelu"},
    ],
)
def test_the_plans_matrices_are_the_ones_muon_updates(model: dict) -> None:
    cfg = configure({f"model.{k}": v for k, v in model.items()}).model
    cfg.dim, cfg.n_layers, cfg.n_heads, cfg.ffn_dim = 32, 2, 4, 64
    built = models.build(cfg)
    for layer, block in built.layers.items():
        groups = param_groups(nn.ModuleDict({"layers": block}), 0.1, muon=True)
        got = sorted(
            tuple(p.shape[-2:]) for g in groups if g["muon"] for p in g["params"] for _ in
            range(p.shape[0] if p.ndim == 3 else 1)
        )  # fmt: skip
        matrices, experts = block_matrices(cfg, int(layer))
        assert got == sorted(matrices + expert_matrices(cfg) * experts)


def test_under_zero3_the_split_takes_the_work_and_half_the_traffic_off_each_rank() -> None:
    cfg = configure({"optim.name": "muon", "parallel.zero": 3})
    work = muon_work(cfg, resolve_degrees(cfg))
    assert work is not None and work.ranks == 8
    assert work.flops <= work.flops_unsplit / 8 * 1.5 and work.saved_flops > 0
    # Slices to the owner and back, 2 (n-1)/n^2, instead of the all-gather's (n-1)/n.
    assert work.bytes == pytest.approx(work.bytes_unsplit * 2 / 8)


def test_under_ddp_the_split_adds_an_all_gather_of_the_results() -> None:
    cfg = configure({"optim.name": "muon", "parallel.zero": 0})
    work = muon_work(cfg, resolve_degrees(cfg))
    assert work is not None and work.bytes_unsplit == 0
    matrices = sum(r * c for layer in range(8) for r, c in block_matrices(cfg.model, layer)[0])
    assert work.extra_bytes == pytest.approx(4 * matrices * 7 / 8)


def test_turned_off_or_under_zero1_distributed_muon_does_not_split() -> None:
    off = configure({"optim.name": "muon", "parallel.zero": 3, "optim.distributed_muon": False})
    work = muon_work(off, resolve_degrees(off))
    assert work is not None and work.ranks == 1 and work.saved_flops == 0
    assert work.extra_bytes == 0
    zero1 = configure({"optim.name": "muon", "parallel.zero": 1})
    work = muon_work(zero1, resolve_degrees(zero1))
    assert work is not None and work.extra_bytes == 0
    assert muon_work(configure({}), resolve_degrees(configure({}))) is None
