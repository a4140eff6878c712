"""The LM head and cross-entropy in sequence chunks, so full logits never exist at once.

With `train.loss_chunks` > 1 the model's forward stops at the final norm (`head_in_loss`)
and the loss applies the head itself, one sequence chunk at a time, each chunk under
non-reentrant activation checkpointing: forward keeps only the chunk's input (a view of the
hidden states, which the head saves anyway), and backward recomputes that chunk's logits,
so at any moment one chunk's logits and their gradient exist. The price is one more head
matmul per micro-batch.

The head is called as the module it is, so tensor parallelism's plan (column-wise over the
vocabulary, the padded-vocabulary mask) and the vocab-parallel loss apply to each chunk as
they do to whole logits; sequence-sharded hidden states (SP) are gathered first, as the
head's own input plan would. Chunks are of equal length, so the mean of their mean losses
is the mean loss of the whole sequence.

`head` is read at each call and kept with that call's chunks for their recompute, so it may
be pointed at another module between calls: PipeDream-2BW points it at the head of the
weight version whose forward runs, and a micro-batch whose backward runs a step later still
recomputes its logits through the head its forward used.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.utils.checkpoint import checkpoint

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class ChunkedLMLoss:
    """Mean next-token loss of hidden states [b, s, dim] against targets [b, s], through
    `head` in `chunks` equal sequence chunks; `loss_fn` is the loss of one chunk's logits.
    With `sums` it is a sum over positions, and so is the result: the chunks' sums added
    (a multi-token prediction depth's, whose chunks keep different numbers of positions)."""

    def __init__(self, head: nn.Module, chunks: int, loss_fn: LossFn, sums: bool = False) -> None:
        self.head = head
        self.chunks = chunks
        self.loss_fn = loss_fn
        self.sums = sums

    def __call__(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if hidden.shape[1] % self.chunks:
            raise ValueError(
                f"a sequence of {hidden.shape[1]} positions does not split into "
                f"{self.chunks} loss chunks"
            )
        if isinstance(hidden, DTensor):
            hidden = hidden.redistribute(hidden.device_mesh, [Replicate()])
        total: torch.Tensor | None = None
        pairs = zip(hidden.chunk(self.chunks, 1), targets.chunk(self.chunks, 1), strict=True)
        for part, part_targets in pairs:
            loss = checkpoint(self._chunk_loss, part, part_targets, self.head, use_reentrant=False)
            total = loss if total is None else total + loss
        assert total is not None
        return total if self.sums else total / self.chunks

    def _chunk_loss(
        self, hidden: torch.Tensor, targets: torch.Tensor, head: nn.Module
    ) -> torch.Tensor:
        return self.loss_fn(head(hidden), targets)
