"""Tied embeddings under pipeline parallelism, as Megatron does them.

Without PP the LM head is the token embedding: one weight, one gradient. With PP the
embedding sits on the first stage and the head on the last, so the last stage keeps its
own copy of the embedding as its head (same initial value: `models.init` draws the tied
head from the embedding's name). After every backward the two gradients are summed over
the two ranks that hold them (Megatron's embedding group), so both copies take the same
step and stay equal, and the sum is the gradient the shared weight gets in one process.
The copy's gradient is left out of the gradient norm, which counts the weight once.
PipeDream-2BW sums each weight version's two gradients the same way, asynchronously
(`start_tied_grad_sum`), as each rank finishes its gradient of a step.

Both copies are laid out alike: the same vocab-sharded placement under TP and the same
FSDP shard of the stage's root, so their local shards are summed element by element.

Multi-token prediction (models/mtp.py) embeds the tokens ahead on the last stage, which
therefore keeps a copy of the embedding itself, under the embedding's own name
(`keeps_embedding_copy`): the same sum keeps it equal to the first stage's, a checkpoint holds
both under one name, and a tied head there is that copy. Under a V schedule the copy sits on
the embedding's own rank: the pipeline view leaves it out (`StageView.embedding_copies`), its
gradient is summed into the embedding's, and `sync_embedding_copies` gives it the
embedding's weights before every step (its only reader is the step's MTP modules).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from pretrain.core.layout import Degrees, rank_groups
from pretrain.core.schema import RecipeConfig
from pretrain.core.stages import placement, rank_stages
from pretrain.parallel.tensor import local_value

HEAD_COPY = "embedding_copy"
"""Attribute set on a module of a stage whose weight copies an embedding held elsewhere (a
last stage's tied LM head, or the embedding it keeps for its MTP modules)."""


def mark_head_copy(stage: nn.Module) -> None:
    """Flag the LM head of a stage that holds it without the embedding it is tied to, and
    the embedding a later stage keeps for its multi-token prediction modules."""
    tied = stage.cfg.tie_embeddings
    if tied and stage.output is not None and stage.tok_embeddings is None:
        setattr(stage.output, HEAD_COPY, True)
    if getattr(stage, "keeps_embedding_copy", False):
        setattr(stage.tok_embeddings, HEAD_COPY, True)


def _is_copy(module: nn.Module | None) -> bool:
    return getattr(module, HEAD_COPY, False)


def head_copies(model: nn.Module) -> list[nn.Parameter]:
    """The parameters of `model` that copy an embedding (weight decay and norm skip them)."""
    return [p for m in model.modules() if getattr(m, HEAD_COPY, False) for p in m.parameters()]


def embedding_group(cfg: RecipeConfig, degrees: Degrees) -> dist.ProcessGroup | None:
    """The group of this rank's pipeline ranks that hold the first and the last stage, when
    they are two (every rank must call this, in the same order: it creates the groups)."""
    if not (cfg.model.tie_embeddings or cfg.model.mtp_layers) or degrees.pp == 1:
        return None
    p = cfg.parallel
    last, style = p.pp * p.vpp - 1, placement(p.pp_schedule)
    # In a V the first rank holds both ends: the copy's gradient is summed on that rank.
    first_rank = next(r for r in range(p.pp) if 0 in rank_stages(r, p.pp, p.vpp, style))
    last_rank = next(r for r in range(p.pp) if last in rank_stages(r, p.pp, p.vpp, style))
    if first_rank == last_rank:
        return None
    mine = None
    for ranks in rank_groups(degrees)["pp"]:
        group = dist.new_group([ranks[first_rank], ranks[last_rank]])
        if dist.get_rank() in (ranks[first_rank], ranks[last_rank]):
            mine = group
    return mine


def reduce_tied_grads(model: nn.Module, group: dist.ProcessGroup | None) -> None:
    """Sum the embedding's and its head copy's gradients wherever they are held (call once
    per step after the last backward; a no-op for a model without a copy on this rank's
    pipeline)."""
    embedding = getattr(model, "tok_embeddings", None)
    for copy in _hidden_copies(model):
        # No optimizer zeroes it: its gradient moves into the embedding's.
        if copy.grad is not None and embedding is not None:
            local_value(embedding.weight.grad).add_(local_value(copy.grad))
            copy.grad = None
    held = head_copies(model)
    if embedding is not None and not _is_copy(embedding) and (group is not None or held):
        held.insert(0, embedding.weight)
    grads = [local_value(p.grad) for p in held if p.grad is not None]
    if len(grads) == 2:
        # Both on this rank (first and last stage in one rank's chunks).
        grads[0].add_(grads[1])
        grads[1].copy_(grads[0])
    elif grads and group is not None:
        dist.all_reduce(grads[0], group=group)


def _hidden_copies(model: nn.Module) -> list[nn.Parameter]:
    """The weights of the embedding copies a pipeline view keeps beside the embedding
    (`StageView.embedding_copies`: the MTP modules' under a V schedule)."""
    return [p for m in getattr(model, "embedding_copies", []) for p in m.parameters()]


@torch.no_grad()
def sync_embedding_copies(model: nn.Module) -> None:
    """Give the embedding copies a pipeline view keeps beside the embedding its weights (the
    copies are neither stepped nor saved: call it before a step that reads them)."""
    copies = _hidden_copies(model)
    if copies:
        weight = local_value(model.tok_embeddings.weight)
        for copy in copies:
            local_value(copy).copy_(weight)


def start_tied_grad_sum(model: nn.Module, group: dist.ProcessGroup | None) -> dist.Work | None:
    """Start summing the gradient of this rank's tied weight (the embedding, or the last
    stage's copy of it) with its twin's on the other rank of `group`, without waiting: under
    PipeDream-2BW the two ranks finish a step's gradient at different times. None where no
    group links this rank to a twin."""
    if group is None:
        return None
    embedding = getattr(model, "tok_embeddings", None)
    held = [embedding.weight] if embedding is not None and not _is_copy(embedding) else []
    held = held or head_copies(model)
    if not held or held[0].grad is None:
        return None
    return dist.all_reduce(local_value(held[0].grad), group=group, async_op=True)


EMBEDDING, HEAD = "tok_embeddings.weight", "output.weight"
"""The full model's names of a tied embedding and its LM head."""


def reads_copy_from_embedding(model: nn.Module) -> bool:
    """Whether a checkpoint load gives this stage's copy of a tied embedding the embedding's
    entries (the same tensors): every checkpoint holds those, while one saved without PP
    keeps the shared weight's optimizer states under the embedding's name only."""
    return bool(head_copies(model)) and getattr(model, "tok_embeddings", None) is None


def renamed(entries: dict, old: str, new: str) -> dict:
    """`entries` (keyed by the full model's names) with the key `old` named `new`."""
    return {(new if key == old else key): value for key, value in entries.items()}
