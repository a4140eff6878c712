"""The K/V ring of context parallelism: causal (optionally document-masked) attention of a
cp rank's queries over every cp rank's keys and values.

Each cp rank holds chunks i and 2cp-1-i of 2cp (`chunk_order`). The rank's queries attend
to every rank's keys and values, which travel around the ring of cp ranks
(batch_isend_irecv to the next rank, from the previous, cp-1 hops), each hop overlapped
with the attention over the chunks held. A pair of chunks is computed whole when the key
chunk precedes the query chunk, with the causal mask when they are the same chunk, and not
at all when the key chunk comes later. Partial results merge by their log-sum-exp. The
backward is a second ring: keys and values travel again, followed by their gradients,
which reach their owner one hop after the last block. Only q, k, v, the output and the
log-sum-exp are saved, so the attention keeps 1/cp of its activations per rank. Keys and
values travel as one tensor joined on the last dim, so keys may be wider than values
(multi-head latent attention's decompressed ones).

Packed documents: `RingDocuments` holds every cp rank's document ids (gathered once per
forward), and each chunk pair is masked by equal ids as well as causally. A query row may
then see no key of a pair at all (its document began after the key chunk ends): its partial
log-sum-exp is -inf and adds nothing.

torch's `context_parallel` (torch.distributed.tensor.experimental) does not run on CPU: its
SDPA dispatch has no sharding rule for aten._scaled_dot_product_flash_attention_for_cpu
(NotImplementedError, torch 2.13 with gloo). One in-repo ring runs on every device instead,
so the CPU tests cover the code a GPU runs. A chunk pair's attention runs one of two kernels
(`fuses` picks): the device's fused flash attention (CUDA's FlashAttention-2 in BF16/FP16,
the CPU's flash kernel in FP32), which returns the log-sum-exp the merge needs and whose backward
takes the final output and log-sum-exp, as a ring's backward must (MLA's narrower values
padded to the keys' width); or, where no fused kernel applies (packed documents, FP32 on
CUDA), FP32 matmuls over
tiles of QUERY_TILE query rows, so its scores never exceed a tile per head.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pretrain.core import hardware
from pretrain.models.layers import CoreMask

aten = torch.ops.aten


def chunk_order(cp: int, rank: int) -> tuple[int, int]:
    """The two chunks of 2cp that cp rank `rank` holds: (rank, 2cp-1-rank)."""
    return rank, 2 * cp - 1 - rank


class RingAttention:
    """Causal grouped-query attention of q [b, heads, s, d] over k, v [b, kv_heads, s, d],
    where s is this rank's head and tail chunks and the other chunks sit on the ring; with
    `RingDocuments`, within each packed document."""

    def __init__(self, group: dist.ProcessGroup, rank: int, cp: int) -> None:
        self.group, self.rank, self.cp = group, rank, cp
        self.probe: Callable[[torch.Tensor], None] | None = None
        """Handed the largest score of this rank's queries over every key they attend to
        (all of the ring's chunks), when set (a stability monitor's sampled steps)."""
        self.next = dist.get_global_rank(group, (rank + 1) % cp)
        self.prev = dist.get_global_rank(group, (rank - 1) % cp)

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        documents: RingDocuments | None = None,
    ) -> torch.Tensor:
        return _RingAttention.apply(q, k, v, self, documents)

    def documents(self, doc_ids: torch.Tensor) -> RingDocuments:
        """Every cp rank's document ids, from this rank's [b, s] (collective over cp)."""
        gathered = doc_ids.new_empty(self.cp * doc_ids.shape[0], doc_ids.shape[1])
        dist.all_gather_into_tensor(gathered, doc_ids.contiguous(), group=self.group)
        return RingDocuments(gathered.view(self.cp, *doc_ids.shape))

    def holder(self, hop: int) -> int:
        """The cp rank whose keys and values this rank holds after `hop` hops."""
        return (self.rank - hop) % self.cp

    def exchange(self, outgoing: torch.Tensor) -> tuple[torch.Tensor, list]:
        """Start sending `outgoing` to the next rank and receiving its like from the previous;
        returns the receive buffer and the works to wait for."""
        incoming = torch.empty_like(outgoing)
        works = dist.batch_isend_irecv(
            [
                dist.P2POp(dist.isend, outgoing, self.next, self.group),
                dist.P2POp(dist.irecv, incoming, self.prev, self.group),
            ]
        )
        return incoming, works


@dataclass(frozen=True)
class RingDocuments(CoreMask):
    """The document of each position held by every cp rank, [cp, b, s]: a query attends to
    a key of its own document only."""

    ids: torch.Tensor

    def halves(self, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cp rank `rank`'s ids of its head and of its tail chunk, [b, s/2] each."""
        head, tail = self.ids[rank].chunk(2, dim=-1)
        return head, tail


PairDocuments = tuple[torch.Tensor, torch.Tensor] | None
"""Of one chunk pair: the query chunk's and the key chunk's document ids [b, chunk]; None
without document masking."""


def _pairs(cp: int, q_rank: int, kv_rank: int):
    """(query half, key half, causal) of the chunk pairs that see each other: a key chunk
    before the query chunk is seen whole, the same chunk under the causal mask."""
    for qi, q_chunk in enumerate(chunk_order(cp, q_rank)):
        for ki, k_chunk in enumerate(chunk_order(cp, kv_rank)):
            if k_chunk <= q_chunk:
                yield qi, ki, k_chunk == q_chunk


QUERY_TILE = 256
"""Query rows a chunk pair's attention computes at once: its FP32 scores stay a
QUERY_TILE x chunk matrix per head, however long the chunk."""


def _scores(
    q: torch.Tensor, k: torch.Tensor, causal: bool, row: int, docs: PairDocuments = None
) -> torch.Tensor:
    """Scaled scores [b, kv, g, rows, sk] in FP32 of query rows from `row` on; with
    `causal`, the keys after each query's own position are at -inf, and with `docs` the
    keys of other documents."""
    scores = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    rows, keys = scores.shape[-2:]
    if causal:
        future = torch.ones(rows, keys, dtype=torch.bool, device=q.device).triu(1 + row)
        scores = scores.masked_fill(future, float("-inf"))
    if docs is not None:
        q_ids, k_ids = docs
        other = q_ids[:, row : row + rows, None] != k_ids[:, None, :]  # [b, rows, sk]
        scores = scores.masked_fill(other[:, None, None], float("-inf"))
    return scores


def _finite(lse: torch.Tensor) -> torch.Tensor:
    # A row that sees no key of a block has a log-sum-exp of -inf; shifting by 0 instead
    # gives it zero probabilities rather than NaN.
    return lse.masked_fill(lse.isneginf(), 0.0)


def _tiles(length: int):
    return ((row, min(row + QUERY_TILE, length)) for row in range(0, length, QUERY_TILE))


def _block_forward(q, k, v, causal, docs: PairDocuments = None, maxima: list | None = None):
    """Attention of one chunk pair: output [b, kv, g, sq, d] and log-sum-exp [b, kv, g, sq];
    with `maxima`, each tile's largest score is appended to it."""
    outs, lses = [], []
    for row, end in _tiles(q.shape[-2]):
        scores = _scores(q[..., row:end, :], k, causal, row, docs)
        if maxima is not None:
            maxima.append(scores.detach().amax())
        lse = scores.logsumexp(-1)
        outs.append((scores - _finite(lse).unsqueeze(-1)).exp() @ v.float())
        lses.append(lse)
    return torch.cat(outs, dim=-2), torch.cat(lses, dim=-1)


def _merge(out, lse, block_out, block_lse):
    """Two partial attentions over disjoint keys, as one (by their log-sum-exp)."""
    total = torch.logaddexp(lse, block_lse)
    shift = _finite(total)
    merged = out * (lse - shift).exp().unsqueeze(-1)
    return merged + block_out * (block_lse - shift).exp().unsqueeze(-1), total


def _block_backward(q, k, v, out, lse, grad, causal, docs: PairDocuments = None):
    """Gradients (dq, dk, dv) of one chunk pair, from the final output and log-sum-exp
    (finite: every query sees at least its own position)."""
    scale = 1 / math.sqrt(q.shape[-1])
    k32, v32 = k.float(), v.float()
    grad_q, grad_k, grad_v = [], torch.zeros_like(k32), torch.zeros_like(v32)
    for row, end in _tiles(q.shape[-2]):
        q_rows, g_rows = q[..., row:end, :].float(), grad[..., row:end, :]
        scores = _scores(q_rows, k, causal, row, docs)
        probs = (scores - lse[..., row:end].unsqueeze(-1)).exp()
        grad_v += (probs.transpose(-1, -2) @ g_rows).sum(2, keepdim=True)
        grad_probs = g_rows @ v32.transpose(-1, -2)
        rowsum = (g_rows * out[..., row:end, :]).sum(-1, keepdim=True)
        grad_scores = probs * (grad_probs - rowsum)
        grad_q.append(grad_scores @ k32 * scale)
        grad_k += (grad_scores.transpose(-1, -2) @ q_rows).sum(2, keepdim=True) * scale
    return torch.cat(grad_q, dim=-2), grad_k, grad_v


def fuses(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: object) -> bool:
    """Whether the ring's chunk pairs run the device's fused flash attention
    (`hardware.fused_ring_attention`); values narrower than the keys (MLA's) are padded to
    the keys' width for it, wider ones are not."""
    half = q.dtype in (torch.bfloat16, torch.float16)
    masked = documents is not None
    kernel = hardware.fused_ring_attention(q.device.type, half, q.shape[-1], masked)
    return kernel and v.shape[-1] <= k.shape[-1]


def _heads(x: torch.Tensor, group: int) -> torch.Tensor:
    """Keys or values [b, kv, 1, s, d] repeated for each of the `group` query heads sharing
    them, [b, kv * group, s, d] (FlashAttention is given as many key heads as query heads)."""
    b, kv, _, s, d = x.shape
    return x.expand(b, kv, group, s, d).reshape(b, kv * group, s, d)


def _flash_forward(q, k, v, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The device's flash attention of [b, h, s, d] tensors: output and FP32 log-sum-exp
    [b, h, sq]. Arguments after the tensors go by name, as torch has added optional ones
    between them. CUDA's kernel runs in the inputs' half precision, so each pair's output
    and gradients are rounded to it before the FP32 merge (as torch's own context
    parallelism rounds them); the CPU's runs in FP32, the precision the one-process SDPA
    accumulates in, so that the CPU tests compare the ring's algebra, not that rounding."""
    if q.device.type == "cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu(
            q.float(), k.float(), v.float(), dropout_p=0.0, is_causal=causal
        )
    out, lse = aten._scaled_dot_product_flash_attention(q, k, v, dropout_p=0.0, is_causal=causal)[
        :2
    ]
    return out, lse


def _flash_backward(grad, q, k, v, out, lse, causal: bool) -> tuple[torch.Tensor, ...]:
    """(dq, dk, dv) of `_flash_forward` from the given output and log-sum-exp: the ring
    passes the merged ones, with which each pair's probabilities and the softmax's row term
    are the whole attention's."""
    if q.device.type == "cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            *(x.float() for x in (grad, q, k, v, out)), lse, dropout_p=0.0, is_causal=causal
        )
    # Without dropout the random state is unread; dense (not variable-length) batches have
    # no cumulative lengths, and their longest sequences are the chunks'.
    seed = torch.empty(2, dtype=torch.uint64, device=q.device)
    offset = torch.empty((), dtype=torch.uint64, device=q.device)
    return aten._scaled_dot_product_flash_attention_backward(
        grad, q, k, v, out, lse,
        cum_seq_q=None, cum_seq_k=None, max_q=q.shape[-2], max_k=k.shape[-2],
        dropout_p=0.0, is_causal=causal, philox_seed=seed, philox_offset=offset,
    )  # fmt: skip


def _pair_maximum(q, k, causal: bool, docs: PairDocuments = None) -> torch.Tensor:
    """The largest score of one chunk pair, tile by tile (for a stability probe: the fused
    kernel does not expose its scores)."""
    return torch.stack(
        [
            _scores(q[..., row:end, :], k, causal, row, docs).amax()
            for row, end in _tiles(q.shape[-2])
        ]
    ).amax()


def _fused_forward(q, k, v, causal, docs: PairDocuments = None, maxima: list | None = None):
    """`_block_forward` by the device's flash attention (no documents: `fuses`): output in
    FP32 for the merge, log-sum-exp. Values narrower than the keys get zero columns up to
    their width (flash kernels take one head dim), which add zero columns to the output."""
    b, kv, group, sq, d = q.shape
    if maxima is not None:
        maxima.append(_pair_maximum(q, k, causal).detach())
    width = v.shape[-1]
    out, lse = _flash_forward(
        q.reshape(b, kv * group, sq, d), _heads(k, group), _padded(_heads(v, group), d), causal
    )
    out = out if width == d else out[..., :width]
    return out.float().reshape(b, kv, group, sq, width), lse.reshape(b, kv, group, sq)


def _fused_backward(q, k, v, out, lse, grad, causal, docs: PairDocuments = None):
    """`_block_backward` by the device's flash attention; `out` and `grad` in the compute
    dtype. The repeated key heads' gradients are summed back onto their key head; padded
    values' zero columns get zero output gradients, and their gradients are dropped."""
    b, kv, group, sq, d = q.shape
    sk, heads, width = k.shape[-2], kv * group, v.shape[-1]
    dq, dk, dv = _flash_backward(
        _padded(grad.reshape(b, heads, sq, width), d),
        q.reshape(b, heads, sq, d),
        _heads(k, group),
        _padded(_heads(v, group), d),
        _padded(out.reshape(b, heads, sq, width), d),
        lse.reshape(b, heads, sq),
        causal,
    )
    dk = dk.float().reshape(b, kv, group, sk, d).sum(2, keepdim=True)
    dv = (dv if width == d else dv[..., :width]).float().reshape(b, kv, group, sk, width)
    dv = dv.sum(2, keepdim=True)
    return dq.float().reshape(q.shape), dk, dv


def _padded(x: torch.Tensor, width: int) -> torch.Tensor:
    """`x` with zero columns up to `width` on its last dim."""
    if x.shape[-1] == width:
        return x
    return torch.cat((x, x.new_zeros(*x.shape[:-1], width - x.shape[-1])), dim=-1)


def _halves(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x.chunk(2, dim=-2)


def _joined(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Keys and values as the one tensor that travels, [b, kv, 1, s, dk + dv]: concatenated
    on the last dim, since MLA's keys are wider than its values."""
    return torch.cat((k, v), dim=-1).unsqueeze(2)


def _kv_halves(kv: torch.Tensor, dk: int) -> tuple[tuple, tuple]:
    """The head and tail chunks of the keys and of the values in a `_joined` tensor."""
    return _halves(kv[..., :dk]), _halves(kv[..., dk:])


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring: RingAttention, documents: RingDocuments | None):
        b, heads, s, d = q.shape
        kv_heads, width = k.shape[1], k.shape[-1]
        # Query head h uses key/value head h // (heads / kv_heads), as enable_gqa does.
        qg = q.reshape(b, kv_heads, heads // kv_heads, s, d)
        kv = _joined(k, v)
        fused = fuses(q, k, v, documents)
        block_forward = _fused_forward if fused else _block_forward
        outs: list = [None, None]
        lses: list = [None, None]
        maxima: list | None = None if ring.probe is None else []
        q_halves = _halves(qg)
        for hop in range(ring.cp):
            pending = ring.exchange(kv) if hop < ring.cp - 1 else None
            k_halves, v_halves = _kv_halves(kv, width)
            holder = ring.holder(hop)
            for qi, ki, causal in _pairs(ring.cp, ring.rank, holder):
                docs = _pair_documents(documents, ring.rank, qi, holder, ki)
                block = block_forward(
                    q_halves[qi], k_halves[ki], v_halves[ki], causal, docs, maxima
                )
                if outs[qi] is None:
                    outs[qi], lses[qi] = block
                else:
                    outs[qi], lses[qi] = _merge(outs[qi], lses[qi], *block)
            if pending is not None:
                kv, works = pending
                for work in works:
                    work.wait()
        # Saved in the compute dtype and laid out [b, s, heads, d] as SDPA's output is, so the
        # output projection reads it through a view instead of saving a copy.
        out = torch.cat(outs, dim=-2).reshape(b, heads, s, v.shape[-1]).to(q.dtype)
        out = out.transpose(1, 2).contiguous().transpose(1, 2)
        lse = torch.cat(lses, dim=-1)
        if ring.probe is not None and maxima:
            ring.probe(torch.stack(maxima).amax())
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.documents, ctx.fused = ring, documents, fused
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        ring: RingAttention = ctx.ring
        b, heads, s, d = q.shape
        kv_heads, width = k.shape[1], k.shape[-1]
        qg = q.reshape(b, kv_heads, heads // kv_heads, s, d)
        out_shape = (*qg.shape[:-1], v.shape[-1])
        # The fused kernel takes the output and its gradient in the compute dtype (as its
        # own backward would), the tiled one computes in FP32.
        block_backward, dtype = (
            (_fused_backward, q.dtype) if ctx.fused else (_block_backward, torch.float32)
        )
        grad = grad_out.reshape(out_shape).to(dtype)
        q_halves, out_halves = _halves(qg), _halves(out.reshape(out_shape).to(dtype))
        lse_halves, grad_halves = lse.chunk(2, dim=-1), _halves(grad)
        grad_q = [torch.zeros_like(h, dtype=torch.float32) for h in q_halves]
        kv = _joined(k, v)
        grad_kv = torch.zeros_like(kv, dtype=torch.float32)
        for hop in range(ring.cp):
            pending = ring.exchange(kv) if hop < ring.cp - 1 else None
            k_halves, v_halves = _kv_halves(kv, width)
            gk_halves, gv_halves = _kv_halves(grad_kv, width)
            holder = ring.holder(hop)
            for qi, ki, causal in _pairs(ring.cp, ring.rank, holder):
                dq, dk, dv = block_backward(
                    q_halves[qi],
                    k_halves[ki],
                    v_halves[ki],
                    out_halves[qi],
                    lse_halves[qi],
                    grad_halves[qi],
                    causal,
                    _pair_documents(ctx.documents, ring.rank, qi, holder, ki),
                )
                grad_q[qi] += dq
                gk_halves[ki].add_(dk)
                gv_halves[ki].add_(dv)
            # The gradients travel one hop behind their keys and values: after the last
            # block this hop brings each rank its own (a ring of one rank holds its own).
            grad_works = []
            if ring.cp > 1:
                grad_kv, grad_works = ring.exchange(grad_kv)
            if pending is not None:
                kv, works = pending
                for work in works:
                    work.wait()
            for work in grad_works:
                work.wait()
        grad_k, grad_v = grad_kv.squeeze(2).split([width, v.shape[-1]], dim=-1)
        dq = torch.cat(grad_q, dim=-2).reshape(b, heads, s, d)
        return dq.to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype), None, None


def _pair_documents(
    documents: RingDocuments | None, q_rank: int, qi: int, kv_rank: int, ki: int
) -> PairDocuments:
    """The document ids of a chunk pair: half `qi` of q_rank's chunks, half `ki` of
    kv_rank's."""
    if documents is None:
        return None
    return documents.halves(q_rank)[qi], documents.halves(kv_rank)[ki]
