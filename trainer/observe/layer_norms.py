"""Squared norms per layer of a model's parameters (or gradients, or updates), correct under
every layout, without a collective of their own.

Parameters are grouped by the layer they belong to: `embed` (the token embedding),
`layer_<i>` (block i, by its global index) and `head` (the final norm and the LM head). Each
rank adds the squared norm of the pieces it holds, weighted by one over the number of ranks
that hold the same piece, so that one sum over every rank (`StabilityMonitor.collect`)
counts each weight once: a plain tensor is whole on every rank of its pipeline stage (data
parallel replicas, tensor-parallel replicas of the norms); a DTensor is split over the mesh
dims it is not replicated on (tensor parallelism, FSDP, expert parallelism), so as many
fewer ranks hold each of its shards. Pipeline stages hold different layers and add nothing
for the others'. A tied head's copy on the last stage (`head_copies`) is left out: the
embedding counts it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate

from pretrain.parallel.pipeline.tied_embedding import head_copies
from pretrain.parallel.tensor import local_value


def layer_groups(n_layers: int) -> list[str]:
    """Every group's name, in the order of the vectors `squared_norms` returns."""
    return ["embed", *(f"layer_{i}" for i in range(n_layers)), "head"]


def group_of(name: str) -> str:
    """The group of a parameter by its name in the full model (a stage view's name too)."""
    parts = name.split(".")
    if parts[0] == "layers":
        return f"layer_{parts[1]}"
    return "embed" if parts[0] == "tok_embeddings" else "head"


def _resolved(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` with a partial sum finished (a collective over the ranks that hold its
    parts, which reach this line together: it runs where clipping does)."""
    if isinstance(tensor, DTensor) and any(isinstance(p, Partial) for p in tensor.placements):
        placements = [Replicate() if isinstance(p, Partial) else p for p in tensor.placements]
        return tensor.redistribute(tensor.device_mesh, placements)
    return tensor


def _like(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`local` (a piece of the shape of `param`'s) laid out as `param` is, so that its copies
    are counted as `param`'s are."""
    if not isinstance(param, DTensor):
        return local
    return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False)


def _copies(tensor: torch.Tensor, stage_ranks: int) -> int:
    """How many ranks hold the same piece of `tensor` (resolved) as this one."""
    if not isinstance(tensor, DTensor):
        return stage_ranks
    mesh = tensor.device_mesh
    split = math.prod(mesh.size(d) for d, p in enumerate(tensor.placements) if not p.is_replicate())
    return max(1, stage_ranks // split)


class LayerNorms:
    """The parameters of a model view by group, and their weighted squared norms."""

    def __init__(self, model: nn.Module, n_layers: int, stage_ranks: int) -> None:
        """`stage_ranks`: the ranks of one pipeline stage (the world over pp)."""
        index = {g: i for i, g in enumerate(layer_groups(n_layers))}
        skip = {id(p) for p in head_copies(model)}
        self.size = len(index)
        self.stage_ranks = stage_ranks
        self.params = [(n, p) for n, p in model.named_parameters() if id(p) not in skip]
        self.slots = torch.tensor([index[group_of(n)] for n, _ in self.params], dtype=torch.long)

    def squared(self, tensors: Iterable[torch.Tensor | None]) -> torch.Tensor:
        """[groups] float64: the weighted squared norms of `tensors` (one per parameter, in
        `params` order; None adds nothing), summed by group on this rank."""
        pieces, slots, weights = [], [], []
        for i, tensor in enumerate(tensors):
            if tensor is not None:
                tensor = _resolved(tensor)
                pieces.append(local_value(tensor).detach())
                slots.append(i)
                weights.append(1.0 / _copies(tensor, self.stage_ranks))
        out = torch.zeros(self.size, dtype=torch.float64)
        if not pieces:
            return out
        norms = torch._foreach_norm(pieces, 2.0, dtype=torch.float32)
        squares = torch.stack(norms).double().cpu().pow(2)  # one device sync
        chosen = self.slots[torch.tensor(slots, dtype=torch.long)]
        return out.index_add_(0, chosen, squares * torch.tensor(weights, dtype=torch.float64))

    def gradients(self) -> torch.Tensor:
        """Weighted squared gradient norms by group."""
        return self.squared(p.grad for _, p in self.params)

    def weights_now(self) -> torch.Tensor:
        """Weighted squared parameter norms by group."""
        return self.squared(p for _, p in self.params)

    def snapshot(self) -> list[torch.Tensor]:
        """A copy of this rank's pieces of the parameters (before an update)."""
        return [local_value(p).detach().clone() for _, p in self.params]

    def changes(self, before: list[torch.Tensor]) -> torch.Tensor:
        """Weighted squared norms by group of the change since `before` (`snapshot`)."""
        now = (local_value(p).detach() for _, p in self.params)
        return self.squared(
            _like(p, new - old) for (_, p), new, old in zip(self.params, now, before, strict=True)
        )
