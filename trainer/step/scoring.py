"""The log-likelihood of marked target tokens, per sequence: what a multiple-choice task
scores each choice by (`trainer/evals/`), through any stepper's forward-only pass.

A row's score is the sum, over its positions whose target is not IGNORE, of the log
probability of the target token, and whether every one of those tokens is the model's most
likely one (greedy), in FP32. Under tensor parallelism the logits are sharded over the
vocabulary and the log-softmax is the vocab-parallel one (`loss_parallel`, which the stepper
enters). A model whose loss applies the LM head (`train.loss_chunks` > 1) hands over the
final norm's output, and the head is applied here in as many sequence chunks, so full logits
never exist at once either.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

IGNORE = -100
"""The target of a position that is not scored (cross-entropy's default ignore index)."""


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A plain tensor of `tensor`'s full value (a DTensor's reduced or gathered value)."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _scores_of_logits(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """[b, 2]: (summed log-likelihood, tokens that were not the argmax) of each row."""
    logp = F.log_softmax(logits.float(), dim=-1)
    best = whole(logp.amax(-1))
    nll = F.cross_entropy(
        logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE, reduction="none"
    )
    chosen = -whole(nll).view(targets.shape)
    scored = targets != IGNORE
    # The target is the argmax when its log-probability is the largest one (up to rounding
    # between the two paths that computed them).
    missed = scored & (chosen < best - 1e-5 * best.abs().clamp(min=1.0))
    return torch.stack([chosen.masked_fill(~scored, 0).sum(1), missed.sum(1).float()], dim=1)


@torch.no_grad()
def row_scores(
    output: torch.Tensor, targets: torch.Tensor, head: nn.Module | None = None, chunks: int = 1
) -> torch.Tensor:
    """[b, 2] per row of `targets` [b, s]: the summed log-likelihood of its scored targets
    and how many of them were not the most likely token (0: greedy). `output` is the logits,
    or with `head` the hidden states the head turns into logits, `chunks` sequence chunks at
    a time."""
    if head is None:
        return _scores_of_logits(output, targets)
    if isinstance(output, DTensor):  # sequence-parallel hidden states: whole sequences
        output = output.redistribute(output.device_mesh, [Replicate()])
    parts = zip(output.chunk(chunks, 1), targets.chunk(chunks, 1), strict=True)
    return sum(_scores_of_logits(head(h), t) for h, t in parts)  # type: ignore[return-value]
