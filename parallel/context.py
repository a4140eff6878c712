"""Context parallelism: each sequence split over the cp ranks, attention by a ring of K/V.

Layout: the sequence is cut into 2 cp equal chunks and cp rank i holds chunks i and
2cp-1-i (head and tail), so under the causal mask every rank has the same work: the first
rank's early chunk sees little and its late chunk sees almost everything. The step feeds
each rank its chunks of the inputs and targets (`ContextSplit.shard`); the rotary tables are
indexed by the tokens' global positions (`Transformer.positions`), so a token is rotated
exactly as in the unsplit sequence.

Attention (`RingAttention`, swapped into each block's `Attention.core`, or MLA's): the
rank's queries attend to every rank's keys and values, which travel around the ring of cp
ranks (parallel/ring_attention.py).

Packed documents (`data.doc_mask`): the step counts each position's document over the whole
sequence and hands the rank its chunks of the ids; the model passes them to the ring
(`Transformer.documents`), which masks each chunk pair by them.

Mixture-of-experts layers are sequence-local: each cp rank routes and dispatches its own
tokens (under expert parallelism, to the ep ranks of its own cp index). What routing decides
per whole sequence, the capacity queues and the balance loss's fractions, reads the other
chunks' assignment counts, gathered over cp once per MoE layer and forward
(`ContextRouting`): a chunk's queues start behind the earlier chunks' assignments, and each
rank's balance term takes the sequence's fractions with its own tokens' mean scores, so the
mean of the terms over cp is the sequence's loss and its gradient.

Gradients: every cp rank's loss is the mean over its own tokens and the cp ranks of a
sequence hold the same weights, so averaging gradients over dp x cp (`JobMesh.dp_cp`) gives
the gradient of the mean over all tokens; the step averages the loss over cp the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from pretrain.models.moe import WholeSequence, moe_modules
from pretrain.parallel.mesh import JobMesh
from pretrain.parallel.ring_attention import RingAttention, chunk_order


def shard_sequence(tensor: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """This cp rank's head and tail chunks of `tensor` along `dim`, concatenated."""
    chunks = tensor.chunk(2 * cp, dim=dim)
    head, tail = chunk_order(cp, rank)
    return torch.cat([chunks[head], chunks[tail]], dim=dim)


@dataclass
class ContextSplit:
    """What the step needs of context parallelism: this rank's chunks, and their mean or sum
    over cp."""

    rank: int
    size: int
    group: dist.ProcessGroup

    def shard(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's chunks of a [batch, seq] tensor (inputs or targets)."""
        return shard_sequence(tensor, self.size, self.rank)

    def mean(self, value: torch.Tensor) -> torch.Tensor:
        """The mean of `value` over the cp ranks (equal token counts, so the sequence mean)."""
        return self.sum(value) / self.size

    def sum(self, value: torch.Tensor) -> torch.Tensor:
        """The sum of `value` over the cp ranks (a sequence's total over its chunks)."""
        value = value.detach().clone()
        dist.all_reduce(value, group=self.group)
        return value


@dataclass
class HeadTailPositions:
    """Global positions of a cp rank's tokens: its head chunk's, then its tail chunk's."""

    rank: int
    cp: int
    _cache: dict = field(default_factory=dict, repr=False)

    def __call__(self, local_len: int, device: torch.device) -> torch.Tensor:
        key = (local_len, str(device))
        if key not in self._cache:
            chunk = local_len // 2
            head, tail = chunk_order(self.cp, self.rank)
            self._cache[key] = torch.cat(
                [
                    torch.arange(head * chunk, (head + 1) * chunk, device=device),
                    torch.arange(tail * chunk, (tail + 1) * chunk, device=device),
                ]
            )
        return self._cache[key]


def apply_context_parallel(model: nn.Module, mesh: JobMesh) -> None:
    """Swap every block's attention core for the ring and index the rotary tables by global
    position, in place (no-op at cp=1)."""
    if mesh.degrees.cp == 1:
        return
    cp_mesh = mesh.world["cp"]
    ring = RingAttention(cp_mesh.get_group(), cp_mesh.get_local_rank(), mesh.degrees.cp)
    for block in model.layers.values():
        block.attention.core = ring
    model.positions = HeadTailPositions(cp_mesh.get_local_rank(), mesh.degrees.cp)
    model.documents = ring.documents
    routing = ContextRouting(cp_mesh.get_group(), cp_mesh.get_local_rank(), mesh.degrees.cp)
    for moe in moe_modules(model):
        moe.sequence = routing


class ContextRouting(WholeSequence):
    """A MoE block's view of its sequences under cp: two parts (the rank's head and tail
    chunks of 2cp), the other chunks' assignment counts gathered over the cp group."""

    parts = 2

    def __init__(self, group: dist.ProcessGroup, rank: int, cp: int) -> None:
        self.group, self.rank, self.size = group, rank, cp
        # Gathered counts are laid out (cp rank, its head or tail); chunk c of the sequence
        # sits at place where[c] of them.
        where = [0] * (2 * cp)
        for r in range(cp):
            head, tail = chunk_order(cp, r)
            where[head], where[tail] = 2 * r, 2 * r + 1
        self.where = where
        self.own = list(chunk_order(cp, rank))

    def gather_counts(self, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The sequence's assignments per expert before each of this rank's chunks
        [b, 2, N], and in the whole sequence [b, N], from this rank's [b, 2, N]."""
        b, parts, n = counts.shape
        gathered = counts.new_empty(self.size * b, parts, n)
        dist.all_gather_into_tensor(gathered, counts.contiguous(), group=self.group)
        return self.arrange(gathered.view(self.size, b, parts, n))

    def arrange(self, gathered: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`gather_counts` from every cp rank's counts [cp, b, 2, N]."""
        cp, b, parts, n = gathered.shape
        by_rank = gathered.transpose(0, 1).reshape(b, cp * parts, n)
        chunks = by_rank[:, self.where]  # [b, 2cp, N] in sequence order
        before = chunks.cumsum(1) - chunks
        return before[:, self.own], chunks.sum(1)


def context_split(mesh: JobMesh) -> ContextSplit | None:
    """The step's view of context parallelism; None at cp=1."""
    if mesh.degrees.cp == 1:
        return None
    cp_mesh = mesh.world["cp"]
    return ContextSplit(cp_mesh.get_local_rank(), mesh.degrees.cp, cp_mesh.get_group())
