"""Global gradient-norm clipping over plain and DTensor gradients together.

The stock `clip_grad_norm_` cannot mix DTensor and plain gradients. Here gradients are
grouped by how they are laid out: each group's squared norm is computed on local shards and
summed over the mesh dims that shard it, so every parameter is counted exactly once.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate


def _local_squared_norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    norms = torch._foreach_norm(tensors, 2.0)
    return torch.stack([n.float() for n in norms]).pow(2).sum()


def _dtensor_squared_norm(grads: list[DTensor]) -> torch.Tensor:
    mesh, placements = grads[0].device_mesh, grads[0].placements
    if any(isinstance(p, Partial) for p in placements):
        # A partial gradient is a sum still to be done: finish it before taking a norm.
        resolved = [Replicate() if isinstance(p, Partial) else p for p in placements]
        grads = [g.redistribute(mesh, resolved) for g in grads]
        placements = tuple(resolved)
    total = _local_squared_norm([g.to_local() for g in grads])
    for dim, placement in enumerate(placements):
        # Anything but Replicate splits the tensor over this dim: Shard, and also the strided
        # shard FSDP2 lays over a tensor-parallel shard on a 2-D (dp, tp) mesh.
        if not placement.is_replicate():
            dist.all_reduce(total, group=mesh.get_group(dim))
    return total


def grad_norm(
    parameters: Iterable[torch.nn.Parameter], extra_group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """The global L2 norm of all gradients; `extra_group` sums over pipeline stages."""
    groups: dict[object, list[torch.Tensor]] = {}
    for p in parameters:
        if p.grad is None:
            continue
        g = p.grad
        key = (g.device_mesh, g.placements) if isinstance(g, DTensor) else None
        groups.setdefault(key, []).append(g)
    device = next(iter(groups.values()))[0].device if groups else torch.device("cpu")
    total = torch.zeros((), device=device)
    for key, grads in groups.items():
        total += _local_squared_norm(grads) if key is None else _dtensor_squared_norm(grads)
    if extra_group is not None:
        dist.all_reduce(total, group=extra_group)
    return total.sqrt()


def clip_grad_norm_(
    parameters: Iterable[torch.nn.Parameter],
    max_norm: float,
    extra_group: dist.ProcessGroup | None = None,
    uncounted: Iterable[torch.nn.Parameter] = (),
) -> torch.Tensor:
    """Scale gradients so their global norm is at most `max_norm`; return the norm before.

    `uncounted` parameters hold a gradient another rank holds too (a tied embedding's copy):
    they are scaled but left out of the norm, which counts each weight once.
    `max_norm <= 0` only measures.
    """
    params = [p for p in parameters if p.grad is not None]
    skip = {id(p) for p in uncounted}
    norm = grad_norm([p for p in params if id(p) not in skip], extra_group)
    clip_to_norm(params, norm, max_norm)
    return norm


def clip_to_norm(
    parameters: Iterable[torch.nn.Parameter], norm: torch.Tensor, max_norm: float
) -> None:
    """Scale gradients whose global norm is `norm` (however it was computed) so that it is
    at most `max_norm`; `max_norm <= 0` leaves them."""
    if max_norm <= 0:
        return
    params = [p for p in parameters if p.grad is not None]
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    local = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params]
    torch._foreach_mul_(local, coef)
