"""Context parallelism: which chunks a rank holds, what the ring computes, and the layouts
validation accepts and refuses (each refusal naming the field, the reason and a fix)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from pretrain.core.layout import rank_groups, resolve_degrees
from pretrain.core.model_config import ModelConfig
from pretrain.launcher.plan.plan import make_plan
from pretrain.launcher.validate.recipe import check_runnable, validate
from pretrain.models.layers import document_mask
from pretrain.models.moe import MoEFeedForward, expert_counts_per_sequence
from pretrain.parallel.context import ContextRouting, HeadTailPositions, shard_sequence
from pretrain.parallel.mesh import EXPERT_MESH_DIMS, expert_mesh_ranks
from pretrain.parallel.ring_attention import (
    RingAttention,
    RingDocuments,
    _block_backward,
    _block_forward,
    _fused_backward,
    _fused_forward,
    _merge,
    _pairs,
    chunk_order,
    fuses,
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
        {"parallel.cp": 2, "compile.enabled": True},
        {"parallel.cp": 2, "compile.enabled": True, "model.moe_experts": 8},
        {"parallel.cp": 2, "model.moe_experts": 8, "model.moe_ffn_dim": 256},
        {"parallel.cp": 2, "parallel.ep": 2, "model.moe_experts": 8, "model.moe_ffn_dim": 256},
        {"parallel.cp": 2, "data.doc_mask": True},
        {"parallel.cp": 2, "model.attention": "mla", "model.n_kv_heads": 0},
    ],
)
def test_context_parallel_layouts_are_runnable(overrides) -> None:
    cfg = configure(overrides)
    validate(cfg, for_launch=True)
    assert check_runnable(cfg) == []


def test_cp_ranks_sit_between_dp_shard_and_tp_and_take_their_share_of_the_world() -> None:
    degrees = resolve_degrees(configure({"parallel.cp": 2, "parallel.tp": 2}))
    assert (degrees.dp_shard, degrees.cp, degrees.tp, degrees.grad_replicas) == (2, 2, 2, 4)


@pytest.mark.parametrize(
    "overrides",
    [
        {"parallel.cp": 2, "parallel.ep": 2, "cluster.gpus_per_node": 8},
        {"parallel.cp": 2, "parallel.ep": 2, "parallel.tp": 2, "cluster.gpus_per_node": 16},
        {"parallel.cp": 2, "parallel.ep": 2, "parallel.pp": 2, "cluster.gpus_per_node": 16},
        {
            "parallel.cp": 2,
            "parallel.ep": 2,
            "parallel.tp": 4,
            "parallel.etp": 2,
            "cluster.gpus_per_node": 32,
        },
    ],
)
def test_expert_groups_under_cp_are_the_planned_ones_and_replicas_span_cp(overrides) -> None:
    """The trainer's ep and etp groups are the plan's (dp ranks of one cp and tp index;
    consecutive ranks of a tp group); the ranks holding the same experts (edp) are the rest
    of dp times cp."""
    degrees = resolve_degrees(configure({**overrides, "model.moe_experts": 8}))
    ranks = expert_mesh_ranks(degrees)
    assert sorted(ranks.flatten().tolist()) == list(range(degrees.world))

    def groups_along(dim: str) -> list[list[int]]:
        at = EXPERT_MESH_DIMS.index(dim)
        return ranks.movedim(at, -1).reshape(-1, ranks.shape[at]).tolist()

    assert sorted(groups_along("ep")) == sorted(rank_groups(degrees)["ep"])
    assert sorted(groups_along("etp")) == sorted(rank_groups(degrees)["etp"])
    edp_groups = groups_along("edp")
    assert all(len(group) == degrees.dp // degrees.ep * degrees.cp for group in edp_groups)
    cp_of = {r: i for group in rank_groups(degrees)["cp"] for i, r in enumerate(group)}
    assert all({cp_of[r] for r in group} == set(range(degrees.cp)) for group in edp_groups)
    # The ranks holding the same expert slices within a tp group (tp / etp of them) and the
    # etp slices together make up the tp group.
    tp_groups = {tuple(sorted(group)) for group in rank_groups(degrees)["tp"]}
    within = ranks.movedim(EXPERT_MESH_DIMS.index("ep_tp"), -2)
    assert {tuple(sorted(g)) for g in within.reshape(-1, degrees.tp).tolist()} == tp_groups


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


class KnownCounts(ContextRouting):
    """The ring's routing view of one cp rank, fed every rank's counts instead of gathering
    them (no process group)."""

    def __init__(self, rank: int, cp: int, gathered: torch.Tensor) -> None:
        super().__init__(None, rank, cp)  # type: ignore[arg-type]
        self.gathered = gathered

    def gather_counts(self, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        assert torch.equal(counts, self.gathered[self.rank])
        return self.arrange(self.gathered)


@pytest.mark.parametrize("cp", [2, 3])
def test_moe_blocks_on_cp_chunks_route_drop_and_balance_as_on_the_whole_sequence(cp) -> None:
    """Capacity 0.5 drops assignments; each chunk's queues start behind the earlier chunks',
    and the mean over cp of the ranks' balance terms and of their gradients is the
    sequence's."""
    n = 4
    cfg = ModelConfig(
        vocab_size=64,
        dim=8,
        n_heads=2,
        ffn_dim=16,
        n_layers=1,
        moe_experts=n,
        moe_top_k=2,
        moe_ffn_dim=12,
        moe_capacity_factor=0.5,
        moe_aux_loss_coef=1.0,
    )
    torch.manual_seed(0)
    block = MoEFeedForward(cfg)
    for param in block.parameters():
        torch.nn.init.normal_(param, std=0.5)
    x = torch.randn(2, 8 * cp, 8)
    whole = block(x)
    block.aux_loss.backward()
    expected_grad, block.router.weight.grad = block.router.weight.grad, None
    expected_aux, expected_dropped = block.aux_loss.item(), block.stats.totals[n].item()
    assert expected_dropped > 0
    shards = [shard_sequence(x, cp, rank) for rank in range(cp)]
    with torch.no_grad():
        gathered = torch.stack(
            [expert_counts_per_sequence(block.route(shard)[0], n, parts=2) for shard in shards]
        )
    block.stats.reset()
    aux = []
    for rank, shard in enumerate(shards):
        block.sequence = KnownCounts(rank, cp, gathered)
        out = block(shard)
        torch.testing.assert_close(out, shard_sequence(whole, cp, rank), rtol=1e-6, atol=1e-6)
        (block.aux_loss / cp).backward()
        aux.append(block.aux_loss.item())
    assert sum(aux) / cp == pytest.approx(expected_aux, rel=1e-6)
    assert block.stats.totals[n].item() == expected_dropped
    torch.testing.assert_close(block.router.weight.grad, expected_grad, rtol=1e-5, atol=1e-7)


def test_the_plan_says_which_blocks_compile_nothing_under_cp() -> None:
    """Under cp a dense block compiles its feed-forward; a block with routed experts has
    nothing left that traces (parallel/compile.py), and the plan says so."""
    moe = {"parallel.cp": 2, "compile.enabled": True, "model.moe_experts": 8}
    [warning] = [w for w in make_plan(configure(moe)).warnings if "compile.blocks" in w]
    assert "the blocks with routed experts run eagerly" in warning
    dense = make_plan(configure({"parallel.cp": 2, "compile.enabled": True})).warnings
    assert not any("compile.blocks" in w for w in dense)


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


def test_chunk_pairs_masked_by_documents_merge_into_sdpa_under_the_document_mask() -> None:
    """Queries of chunk 1 over keys of chunks 0 and 1, packed documents 0 | 1 | 2 with
    document 2 beginning inside chunk 1: its queries see no key of chunk 0 (a block whose
    log-sum-exp is -inf for them), and the merge and the gradients still equal SDPA's."""
    torch.manual_seed(0)
    b, kv, group, chunk, d = 2, 2, 2, 6, 8
    ids = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 2, 2, 2, 2], [0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 2, 2]])
    q = torch.randn(b, kv * group, chunk, d, dtype=torch.float64, requires_grad=True)
    k = torch.randn(b, kv, 2 * chunk, d, dtype=torch.float64, requires_grad=True)
    v = torch.randn(b, kv, 2 * chunk, d, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(b, kv * group, chunk, d, dtype=torch.float64)
    position = torch.arange(2 * chunk)
    causal = position[chunk:, None] >= position[None, :]
    mask = (ids[:, chunk:, None] == ids[:, None, :]) & causal
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask[:, None], enable_gqa=True
    )
    expected.backward(grad)

    qg = q.detach().view(b, kv, group, chunk, d)
    kg, vg = k.detach().unsqueeze(2), v.detach().unsqueeze(2)
    q_ids, k_ids = ids[:, chunk:], ids.split(chunk, dim=1)
    halves = [
        (kg[..., :chunk, :], vg[..., :chunk, :], False),
        (kg[..., chunk:, :], vg[..., chunk:, :], True),
    ]
    blocks = [
        _block_forward(qg, kh, vh, diagonal, (q_ids, k_ids[i]))
        for i, (kh, vh, diagonal) in enumerate(halves)
    ]
    assert torch.isneginf(blocks[0][1]).any()  # document 2's queries see nothing of chunk 0
    out, lse = _merge(*blocks[0], *blocks[1])
    assert torch.allclose(out.view(b, kv * group, chunk, d).double(), expected, atol=1e-6)
    dq = torch.zeros_like(qg)
    for i, (kh, vh, diagonal) in enumerate(halves):
        g = grad.view(qg.shape).float()
        dq_i, dk, dv = _block_backward(qg, kh, vh, out, lse, g, diagonal, (q_ids, k_ids[i]))
        dq += dq_i
        keys = slice(i * chunk, (i + 1) * chunk)
        assert torch.allclose(dk.squeeze(2).double(), k.grad[..., keys, :], atol=1e-5)
        assert torch.allclose(dv.squeeze(2).double(), v.grad[..., keys, :], atol=1e-5)
    assert torch.allclose(dq.view_as(q), q.grad, atol=1e-5)


@pytest.mark.parametrize("documents", [False, True])
def test_the_ring_of_one_rank_equals_sdpa_for_keys_wider_than_values(
    single_rank_group, documents: bool
) -> None:
    """MLA's shapes (keys nope + rope wide, values narrower, one key head per query head)
    through the whole ring, forward and backward, against SDPA: without documents by the
    flash kernel (values padded to the keys' width), with documents by FP32 tiles under the
    document mask."""
    torch.manual_seed(0)
    b, heads, s, dk, dv = 2, 4, 12, 10, 6
    q = torch.randn(b, heads, s, dk, requires_grad=True)
    k = torch.randn(b, heads, s, dk, requires_grad=True)
    v = torch.randn(b, heads, s, dv, requires_grad=True)
    grad = torch.randn(b, heads, s, dv)
    ids = torch.tensor([[0] * 5 + [1] * 7, [0] * 9 + [1] * 3])
    mask = document_mask(ids) if documents else None
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=mask is None
    )
    expected_grads = torch.autograd.grad(expected, (q, k, v), grad)
    ring = RingAttention(dist.group.WORLD, 0, 1)
    docs = RingDocuments(ids[None]) if documents else None
    assert fuses(q, k, v, docs) is not documents
    out = ring(q, k, v, docs)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    for ours, theirs in zip(torch.autograd.grad(out, (q, k, v), grad), expected_grads, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_ring_of_one_rank_runs_flash_attention_and_equals_sdpa(
    single_rank_group, dtype: torch.dtype
) -> None:
    """Grouped-query shapes without documents take the fused kernel (the CPU's flash
    attention here, in FP32; FlashAttention-2 on CUDA): the merged pairs and their
    gradients, computed from the merged output and log-sum-exp, equal SDPA over the whole
    sequence: in FP32
    within 1e-5 of the exact result, in BF16 as close to the exact result of the rounded
    inputs as SDPA's own BF16 result is (within a quarter of a BF16 step)."""
    torch.manual_seed(0)
    b, heads, kv_heads, s, d = 2, 4, 2, 64, 16
    q, k, v = (torch.randn(b, n, s, d).to(dtype) for n in (heads, kv_heads, kv_heads))
    grad = torch.randn(b, heads, s, d).to(dtype)

    def attention(fn, in_dtype):
        inputs = [t.to(in_dtype).requires_grad_() for t in (q, k, v)]
        out = fn(*inputs)
        grads = torch.autograd.grad(out, inputs, grad.to(in_dtype))
        return [x.double() for x in (out, *grads)]

    def sdpa(*tensors):
        return torch.nn.functional.scaled_dot_product_attention(
            *tensors, is_causal=True, enable_gqa=True
        )

    ring = RingAttention(dist.group.WORLD, 0, 1)
    assert fuses(q, k, v, None)
    exact = attention(sdpa, torch.float64)
    for ours, theirs, truth in zip(
        attention(ring, dtype), attention(sdpa, dtype), exact, strict=True
    ):
        if dtype == torch.float32:
            assert (ours - truth).abs().max() <= 1e-5
        else:
            quarter_step = 2**-9 * truth.abs().max()
            assert (ours - truth).abs().max() <= (theirs - truth).abs().max() + quarter_step


def test_a_stability_probe_sees_the_fused_rings_largest_score(single_rank_group) -> None:
    """The fused kernel keeps no scores, so a sampled step takes each pair's largest one
    tile by tile: the largest causal score of the whole sequence."""
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 2, 600, 8), torch.randn(1, 1, 600, 8), torch.randn(1, 1, 600, 8)
    seen: list[torch.Tensor] = []
    ring = RingAttention(dist.group.WORLD, 0, 1)
    ring.probe = seen.append
    ring(q, k, v)
    scores = q @ k.transpose(-1, -2) / 8**0.5
    causal = torch.ones(600, 600, dtype=torch.bool).tril()
    assert seen[0] == scores.masked_fill(~causal, float("-inf")).amax()


def test_on_cuda_the_fused_pairs_call_flash_attention_with_its_shapes() -> None:
    """CUDA's flash kernels under fake tensors (no GPU here): a grouped pair's output, FP32
    log-sum-exp and gradients come back in the ring's shapes, the key heads' gradients summed
    over the query heads sharing them. FP32, heads wider than 256 and documents take the
    tiled FP32 path instead."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        b, kv, group, s, d = 2, 2, 4, 128, 64
        q = torch.empty(b, kv, group, s, d, device="cuda", dtype=torch.bfloat16)
        k = torch.empty(b, kv, 1, s, d, device="cuda", dtype=torch.bfloat16)
        assert fuses(q, k, k, None)
        out, lse = _fused_forward(q, k, k, causal=True)
        assert (out.shape, out.dtype, lse.shape, lse.dtype) == (
            q.shape, torch.float32, q.shape[:-1], torch.float32,
        )  # fmt: skip
        dq, dk, dv = _fused_backward(q, k, k, out.to(q.dtype), lse, torch.empty_like(q), True)
        assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, k.shape)
        assert not fuses(q.float(), k.float(), k.float(), None)
        wide = torch.empty(b, kv, group, s, 288, device="cuda", dtype=torch.bfloat16)
        assert not fuses(wide, wide, wide, None)
        assert not fuses(q, k, k, RingDocuments(torch.zeros(1, b, s, dtype=torch.long)))
        # MLA's values, narrower than its keys, are padded for the kernel (the padding is
        # checked on CPU: copying a strided fake CUDA tensor needs a CUDA build).
        narrow = torch.empty(b, kv, 1, s, 32, device="cuda", dtype=torch.bfloat16)
        assert fuses(q, k, narrow, None)
