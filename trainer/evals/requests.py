"""Log-likelihood requests (a context and a continuation, in tokens) scored in batches
through the run's own step (`Stepper.score`), so under the training layout.

Each request is one row of `train.seq_len` positions: the end-of-sequence token (how every
document of the packed training data begins, after the previous one's end), the context and
the continuation, cut from the left when longer (the continuation is kept whole where it
fits), then padded; only the continuation's positions are scored. Rows go in global batches
of `train.global_batch` rows, split over the data-parallel ranks and into micro-batches of
`train.micro_batch` as training batches are, so every layout that trains can score; the last
batch is padded with rows that score nothing. Every rank gets every row's score.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from tokenizers import Tokenizer

from pretrain.trainer.step.scoring import IGNORE
from pretrain.trainer.step.state import MicroBatches, Stepper

Request = tuple[list[int], list[int]]
"""(context tokens, continuation tokens)."""


def encode_pair(tokenizer: Tokenizer, context: str, continuation: str) -> Request:
    """The tokens of `context` and of `continuation` after it, split as lm-eval splits them:
    trailing whitespace of the context moves to the continuation, the whole text is encoded
    and the continuation is what follows the context's own encoding."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer.encode(context + continuation).ids
    head = tokenizer.encode(context).ids if context else []
    tail = whole[len(head) :]
    if not tail:  # the merge swallowed the boundary: score the continuation on its own
        tail = tokenizer.encode(continuation).ids
    return head, tail


def request_row(request: Request, eos: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of one request, each [seq_len]: targets IGNORE outside the
    continuation."""
    context, continuation = request
    tokens = ([eos, *context, *continuation])[-(seq_len + 1) :]
    scored = min(len(continuation), len(tokens) - 1)
    length = len(tokens) - 1
    inputs = torch.full((seq_len,), eos, dtype=torch.long)
    targets = torch.full((seq_len,), IGNORE, dtype=torch.long)
    inputs[:length] = torch.tensor(tokens[:-1])
    if scored:
        targets[length - scored : length] = torch.tensor(tokens[-scored:])
    return inputs, targets


@dataclass
class RequestScorer:
    """Scores requests through `stepper` on every rank (collective over the world: every
    rank must call it with the same requests)."""

    stepper: Stepper
    eos: int
    seq_len: int
    global_batch: int
    micro_batch: int
    dp_rank: int
    dp_size: int
    dp_group: dist.ProcessGroup

    def score(self, requests: Sequence[Request]) -> list[tuple[float, bool]]:
        """(log-likelihood of the continuation given the context, whether it is the greedy
        continuation) of each request, in order."""
        rows = [request_row(r, self.eos, self.seq_len) for r in requests]
        padding = -len(rows) % self.global_batch
        blank = (
            torch.full((self.seq_len,), self.eos, dtype=torch.long),
            torch.full((self.seq_len,), IGNORE, dtype=torch.long),
        )
        rows += [blank] * padding
        scores = []
        for start in range(0, len(rows), self.global_batch):
            scores.append(self._batch(rows[start : start + self.global_batch]))
        every = torch.cat(scores)[: len(requests)].tolist()
        return [(loglik, missed == 0) for loglik, missed in every]

    def _batch(self, rows: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """[global_batch, 2] scores of one global batch of rows, gathered from the dp ranks."""
        per_rank = len(rows) // self.dp_size
        mine = rows[self.dp_rank * per_rank : (self.dp_rank + 1) * per_rank]
        micro: MicroBatches = []
        for start in range(0, per_rank, self.micro_batch):
            part = mine[start : start + self.micro_batch]
            micro.append((torch.stack([x for x, _ in part]), torch.stack([y for _, y in part])))
        local = self.stepper.score(micro).to(torch.float64)
        gathered = torch.empty(self.dp_size * per_rank, 2, dtype=local.dtype, device=local.device)
        dist.all_gather_single(gathered, local.contiguous(), group=self.dp_group)
        return gathered.cpu()
