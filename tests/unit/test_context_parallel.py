"""Context parallelism: which chunks a rank holds, what the ring computes, and the layouts
validation accepts and refuses (each refusal naming the field, the reason and a fix)."""

from __future__ import annotations

import pytest
import torch

from pretrain.core.layout import resolve_degrees
from pretrain.launcher.validate.recipe import check_runnable, validate
from pretrain.parallel.context import (
    HeadTailPositions,
    _block_backward,
    _block_forward,
    _pairs,
    chunk_order,
    shard_sequence,
)
from tests.helpers import configure, problems


@pytest.mark.parametrize("cp", [2, 4])
def test_rank_i_holds_chunks_i_and_2cp_minus_1_minus_i(cp: int) -> None:
    seq = torch.arange(8 * cp).view(1, -1)
    chunk = seq.shape[1] // (2 * cp)
    shards = [shard_sequence(seq, cp, rank) for rank in range(cp)]
    for rank, shard in enumerate(shards):
        head, tail = chunk_order(cp, rank)
        assert tail == 2 * cp - 1 - rank
        expected = list(range(head * chunk, (head + 1) * chunk))
        expected += list(range(tail * chunk, (tail + 1) * chunk))
        assert shard[0].tolist() == expected
        # The rotary tables are indexed by exactly these global positions.
        assert HeadTailPositions(rank, cp)(shard.shape[1], torch.device("cpu")).tolist() == (
            expected
        )
    assert sorted(torch.cat(shards, dim=1)[0].tolist()) == seq[0].tolist()


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_the_ring_computes_every_causal_chunk_pair_once_and_balances_the_work(cp: int) -> None:
    """Over cp hops a rank holds every rank's keys once; the pairs it computes must be
    exactly those of the causal mask (key chunk <= query chunk), diagonal ones masked."""
    seen = set()
    work = []
    for rank in range(cp):
        units = 0
        for hop in range(cp):
            holder = (rank - hop) % cp
            for qi, ki, causal in _pairs(cp, rank, holder):
                q_chunk, k_chunk = chunk_order(cp, rank)[qi], chunk_order(cp, holder)[ki]
                assert (q_chunk, k_chunk) not in seen
                assert causal == (q_chunk == k_chunk)
                seen.add((q_chunk, k_chunk))
                units += 1 if causal else 2  # a masked block does about half the work
        work.append(units)
    assert seen == {(q, k) for q in range(2 * cp) for k in range(q + 1)}
    assert len(set(work)) == 1  # head-tail chunks give every rank the same work


@pytest.mark.parametrize(
    "overrides",
    [
        {"parallel.cp": 2},
        {"parallel.cp": 2, "parallel.tp": 4, "parallel.sp": True, "parallel.zero": 3},
        {"parallel.cp": 4, "parallel.pp": 2, "parallel.zero": 2, "recompute.policy": "full"},
        {"parallel.cp": 2, "compile.enabled": True, "compile.blocks": False},
    ],
)
def test_context_parallel_layouts_are_runnable(overrides) -> None:
    cfg = configure(overrides)
    validate(cfg, for_launch=True)
    assert check_runnable(cfg) == []


def test_cp_ranks_sit_between_dp_shard_and_tp_and_take_their_share_of_the_world() -> None:
    degrees = resolve_degrees(configure({"parallel.cp": 2, "parallel.tp": 2}))
    assert (degrees.dp_shard, degrees.cp, degrees.tp, degrees.grad_replicas) == (2, 2, 2, 4)


def test_seq_len_must_split_into_2cp_chunks() -> None:
    cfg = configure({"parallel.cp": 3, "train.seq_len": 256, "cluster.gpus_per_node": 6})
    [problem] = problems(cfg)
    assert problem.field == "train.seq_len"
    assert "2cp = 6 equal chunks" in problem.reason
    assert "252 or 258" in problem.fix


def test_sequence_parallelism_splits_each_cp_share_over_tp() -> None:
    cfg = configure({"parallel.cp": 2, "parallel.tp": 8, "parallel.sp": True, "train.seq_len": 36})
    cfg.cluster.gpus_per_node = 16
    [problem] = [p for p in problems(cfg) if p.field == "train.seq_len"]
    assert "each cp rank's 18 tokens over tp=8" in problem.reason


def test_cp_is_refused_for_mixture_of_experts_models() -> None:
    cfg = configure({"parallel.cp": 2, "model.moe_experts": 8, "model.moe_ffn_dim": 256})
    [problem] = [p for p in problems(cfg) if p.field == "parallel.cp"]
    assert "per whole sequence" in problem.reason
    assert "parallel.cp=1" in problem.fix


def test_compiled_blocks_are_refused_with_cp_for_launch_only() -> None:
    cfg = configure({"parallel.cp": 2, "compile.enabled": True})
    validate(cfg)  # the layout can still be planned
    [problem] = problems(cfg, for_launch=True)
    assert problem.field == "compile.blocks"
    assert "point-to-point exchange" in problem.reason
    assert "compile.blocks=false" in problem.fix


def test_cp_must_divide_the_world() -> None:
    [problem] = [p for p in problems(configure({"parallel.cp": 3})) if p.field != "train.seq_len"]
    assert problem.field == "parallel.dp_shard"
    assert "pp*dp_replicate*cp*tp" in problem.reason


@pytest.mark.parametrize("causal", [True, False])
def test_a_chunk_pairs_tiled_attention_and_its_gradients_equal_sdpa(causal: bool) -> None:
    """600 query rows span three tiles of QUERY_TILE; GQA: 4 query heads over 2 kv heads."""
    torch.manual_seed(0)
    b, kv, group, s, d = 2, 2, 2, 600, 8
    q = torch.randn(b, kv * group, s, d, dtype=torch.float64, requires_grad=True)
    k = torch.randn(b, kv, s, d, dtype=torch.float64, requires_grad=True)
    v = torch.randn(b, kv, s, d, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(b, kv * group, s, d, dtype=torch.float64)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=causal, enable_gqa=True
    )
    expected.backward(grad)
    qg = q.detach().view(b, kv, group, s, d)
    kg, vg = k.detach().unsqueeze(2), v.detach().unsqueeze(2)
    out, lse = _block_forward(qg, kg, vg, causal)
    assert torch.allclose(out.view(b, kv * group, s, d).double(), expected, atol=1e-6)
    dq, dk, dv = _block_backward(qg, kg, vg, out, lse, grad.view(qg.shape).float(), causal)
    assert torch.allclose(dq.view_as(q).double(), q.grad, atol=1e-5)
    assert torch.allclose(dk.squeeze(2).double(), k.grad, atol=1e-5)
    assert torch.allclose(dv.squeeze(2).double(), v.grad, atol=1e-5)
