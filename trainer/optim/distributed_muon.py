"""Distributed Muon: the Newton-Schulz work of a step split over the data-parallel ranks.

Without it every data-parallel rank orthogonalizes every matrix in full (trainer/optim/muon.py
gathers each sharded update whole first). Here each matrix (each expert's, for a stack of
experts) has one owner among the ranks that hold it, `core.optim_states.assign_owners`
balancing their FLOPs, and only the owner orthogonalizes it, on the same FP32 matrix one
process would, so the result is the one-process result. Two ways to move the matrices,
by how the ranks hold them:

- `shard` (FSDP2, ZeRO-2/3: each rank holds a slice of every matrix along one dim): one
  all-to-all sends each slice to its matrix's owner, which joins them, orthogonalizes and
  sends each rank its slice back with a second all-to-all. Each rank moves about twice its
  own share of the matrices, instead of the all-gather of all of them that every rank
  orthogonalizing in full needs.
- `replicate` (DDP, where every rank holds every matrix; and FSDP2 x TP, whose matrices are
  first gathered whole as without the split): each owner orthogonalizes its matrices and an
  all-gather over the group hands every rank all the results. That all-gather is traffic
  the unsplit optimizer does not have; it buys 1/n of the compute.

Experts sharded over ep stay where they are: each rank already holds whole matrices of its
own experts, so the split runs over the ranks that hold the same experts (`edp`). Under
hybrid sharding the replicas of a shard (dp_replicate) each run their shard group's split.
Every rank of a group walks the same matrices in the same order (the optimizer's groups),
so they agree on the owners without a word.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Shard

from pretrain.core.optim_states import assign_owners, newton_schulz_flops
from pretrain.parallel.expert import expert_replicas
from pretrain.parallel.mesh import JobMesh
from pretrain.trainer.optim.whole_matrices import batch_shard, gather_whole, keep_local

SHARD, REPLICATE = "shard", "replicate"


@dataclass(frozen=True)
class SplitGroup:
    """The ranks a matrix's work is split over: the groups of one or more mesh dims, outer
    to inner, and this rank's place among them (row-major over the dims)."""

    groups: tuple[dist.ProcessGroup, ...]
    sizes: tuple[int, ...]
    index: int

    @property
    def size(self) -> int:
        """Ranks in the split."""
        total = 1
        for size in self.sizes:
            total *= size
        return total

    @classmethod
    def of_mesh(cls, mesh: DeviceMesh, dims: Sequence[int]) -> SplitGroup:
        """The ranks along mesh dims `dims` (indices into `mesh`) of this rank's mesh."""
        index = 0
        for dim in dims:
            index = index * mesh.size(dim) + mesh.get_local_rank(dim)
        return cls(
            tuple(mesh.get_group(dim) for dim in dims), tuple(mesh.size(d) for d in dims), index
        )


@dataclass(frozen=True)
class Route:
    """How one parameter's matrices reach their owner and come back."""

    mode: str
    """`shard` or `replicate` (see the module doc)."""
    split: SplitGroup
    dim: int = -1
    """shard: the parameter's (matrix) dim that the split group's ranks slice."""
    gathered: bool = False
    """replicate: the local tensor is a shard to gather whole first (and slice after)."""


def _splits_matrix(placement: Placement, ndim: int) -> bool:
    # A Shard of a matrix dim, or FSDP2's strided shard over TP's (not a Shard subclass).
    return not placement.is_replicate() and not batch_shard(placement, ndim)


def muon_routes(
    model: nn.Module, mesh: JobMesh, params: Sequence[torch.Tensor]
) -> dict[int, Route]:
    """The route of each of `params` (Muon's matrices) whose work a split can share, keyed by
    id; a parameter left out is orthogonalized in full where it is, as without the split."""
    expert_groups = {
        id(p): replicas.mesh for m, replicas in expert_replicas(model) for p in m.parameters()
    }
    # The dims FSDP2 shards over: the dense mesh's shard dim, and the experts' holders.
    shard_dims = {str(mesh.fsdp.mesh_dim_names[-1]), "edp"}
    routes: dict[int, Route] = {}
    for param in params:
        route = _route(param, mesh, expert_groups.get(id(param)), shard_dims)
        if route is not None and route.split.size > 1:
            routes[id(param)] = route
    return routes


def split_line(optimizer: object) -> str | None:
    """The start-up line of a split's routes (on this rank), or None without a split."""
    routes: dict[int, Route] = getattr(optimizer, "routes", {})
    if not routes:
        return None
    modes = sorted({f"{r.mode} over {r.split.size}" for r in routes.values()})
    return f"distributed Muon: {len(routes)} parameters' Newton-Schulz split ({', '.join(modes)})"


def _route(
    param: torch.Tensor, mesh: JobMesh, expert_mesh: DeviceMesh | None, shard_dims: set[str]
) -> Route | None:
    if not isinstance(param, DTensor):
        # Replicated over every rank that reduces gradients together (DDP).
        return Route(REPLICATE, SplitGroup.of_mesh(mesh.dp_cp, [0]))
    pmesh, placements, ndim = param.device_mesh, param.placements, param.ndim
    names = pmesh.mesh_dim_names or ()
    matrix = [d for d, p in enumerate(placements) if _splits_matrix(p, ndim)]
    if len(matrix) == 1 and names[matrix[0]] in shard_dims:
        (d,) = matrix
        if type(placements[d]) is Shard and _holds_chunk(param, d):
            return Route(SHARD, SplitGroup.of_mesh(pmesh, [d]), dim=placements[d].dim)
    if matrix:
        # Gathered whole on every rank of the matrix's dims (and its replicas there).
        whole = [d for d, p in enumerate(placements) if p.is_replicate() or d in matrix]
        return Route(REPLICATE, SplitGroup.of_mesh(pmesh, whole), gathered=True)
    if expert_mesh is not None:
        # Whole matrices of this rank's experts, held alike by the edp ranks (DDP).
        return Route(REPLICATE, SplitGroup.of_mesh(expert_mesh, [0]))
    return None


def chunk_sizes(size: int, parts: int) -> list[int]:
    """The lengths `torch.chunk` (and so DTensor's and FSDP2's Shard) gives each of `parts`
    ranks of a dim of `size`: ceil(size / parts) each, the rest to the last, none beyond."""
    step = -(-size // parts)
    return [max(0, min(size, (i + 1) * step) - i * step) for i in range(parts)]


def _holds_chunk(param: DTensor, mesh_dim: int) -> bool:
    # The slice this rank holds is the torch.chunk of its index: what the owner rebuilds.
    dim = param.placements[mesh_dim].dim
    rank = param.device_mesh.get_local_rank(mesh_dim)
    size = chunk_sizes(param.shape[dim], param.device_mesh.size(mesh_dim))[rank]
    return param.to_local().shape[dim] == size


Orthogonalize = Callable[[torch.Tensor, torch.dtype], torch.Tensor]
"""Muon's Newton-Schulz of a matrix [A, B] or a stack [N, A, B], in a dtype."""


def orthogonalize_routed(
    pending: Sequence[tuple[torch.Tensor, torch.Tensor, Route]],
    orthogonalize: Orthogonalize,
    dtype: torch.dtype,
) -> list[torch.Tensor]:
    """The orthogonalized local update of each (parameter, local update, route) of
    `pending`, each matrix computed by its owner. Collective over every route's group; the
    parameters sharing a group go together, groups in the order they first appear."""
    results: list[torch.Tensor] = [torch.empty(0)] * len(pending)
    buckets: dict[tuple[str, tuple[int, ...]], list[int]] = {}
    for i, (_, _, route) in enumerate(pending):
        key = (route.mode, tuple(id(g) for g in route.split.groups))
        buckets.setdefault(key, []).append(i)
    for members in buckets.values():
        entries = [pending[i] for i in members]
        exchange = _shard_exchange if entries[0][2].mode == SHARD else _replicate_exchange
        for i, result in zip(members, exchange(entries, orthogonalize, dtype), strict=True):
            results[i] = result
    return results


def _owners(counts: Sequence[int], shapes: Sequence[tuple[int, int]], ranks: int) -> list[int]:
    """The owner of each matrix of the entries, in order (entry by entry): `counts[k]`
    matrices of shape `shapes[k]` each."""
    costs = [newton_schulz_flops(*shape) for shape, n in zip(shapes, counts, strict=True)
             for _ in range(n)]  # fmt: skip
    return assign_owners(costs, ranks)


def _newton_schulz(
    matrix: torch.Tensor, stacked: bool, orthogonalize: Orthogonalize, dtype: torch.dtype
) -> torch.Tensor:
    # A matrix of a stack runs the batched iteration, as its whole stack would in one process.
    result = orthogonalize(matrix[None] if stacked else matrix, dtype)
    return (result[0] if stacked else result).float()


def _all_to_all(
    send: list[list[torch.Tensor]], receive: list[int], group: dist.ProcessGroup
) -> list[torch.Tensor]:
    """Send each rank its list of FP32 tensors (every rank sends at least one, perhaps
    empty); what each rank sent here, flat."""
    flat = torch.cat([t.reshape(-1) for to_rank in send for t in to_rank])
    out = flat.new_empty(sum(receive))
    sent = [sum(t.numel() for t in to_rank) for to_rank in send]
    dist.all_to_all_single(out, flat, receive, sent, group=group)
    return list(out.split(receive))


class _Slices:
    """An entry of the shard exchange: this rank's slices of a stack of matrices, the
    matrices' full shape, and the dim (0 or 1 of a matrix) the group slices."""

    def __init__(self, param: torch.Tensor, update: torch.Tensor, route: Route, n: int) -> None:
        self.dim = route.dim - (param.ndim - 2)
        self.rows, self.cols = param.shape[-2], param.shape[-1]
        self.stacked = update.ndim > 2
        self.shape = update.shape
        self.stack = update.reshape(math.prod(update.shape[:-2]), *update.shape[-2:])
        self.sizes = chunk_sizes(param.shape[route.dim], n)

    def piece(self, rank: int) -> tuple[int, int]:
        """The shape of `rank`'s slice of one matrix."""
        size = self.sizes[rank]
        return (size, self.cols) if self.dim == 0 else (self.rows, size)

    def numel(self, rank: int) -> int:
        rows, cols = self.piece(rank)
        return rows * cols


def _shard_exchange(
    entries: Sequence[tuple[torch.Tensor, torch.Tensor, Route]],
    orthogonalize: Orthogonalize,
    dtype: torch.dtype,
) -> list[torch.Tensor]:
    """Each matrix's slices to its owner (one all-to-all), the owner's Newton-Schulz, and
    each rank's slice of the result back (a second)."""
    split = entries[0][2].split
    (group,), n, me = split.groups, split.size, split.index
    sliced = [_Slices(param, update, route, n) for param, update, route in entries]
    matrices = [(k, j) for k, s in enumerate(sliced) for j in range(s.stack.shape[0])]
    owners = _owners([s.stack.shape[0] for s in sliced], [(s.rows, s.cols) for s in sliced], n)
    mine = [m for m, owner in zip(matrices, owners, strict=True) if owner == me]

    send: list[list[torch.Tensor]] = [[] for _ in range(n)]
    for (k, j), owner in zip(matrices, owners, strict=True):
        send[owner].append(sliced[k].stack[j])
    arrived = _all_to_all(send, [sum(sliced[k].numel(src) for k, _ in mine) for src in range(n)],
                          group)  # fmt: skip
    starts = [0] * n
    back: list[list[torch.Tensor]] = [[] for _ in range(n)]
    for k, _ in mine:
        s = sliced[k]
        pieces = []
        for src in range(n):
            numel = s.numel(src)
            pieces.append(arrived[src][starts[src] : starts[src] + numel].view(s.piece(src)))
            starts[src] += numel
        result = _newton_schulz(torch.cat(pieces, s.dim), s.stacked, orthogonalize, dtype)
        for dest, part in enumerate(result.split(s.sizes, s.dim)):
            back[dest].append(part)
    receive = [0] * n
    for (k, _), owner in zip(matrices, owners, strict=True):
        receive[owner] += sliced[k].numel(me)
    returned = _all_to_all(back, receive, group)
    out = [torch.empty_like(s.stack, dtype=torch.float32) for s in sliced]
    starts = [0] * n
    for (k, j), owner in zip(matrices, owners, strict=True):
        numel = sliced[k].numel(me)
        out[k][j] = returned[owner][starts[owner] : starts[owner] + numel].view(sliced[k].piece(me))
        starts[owner] += numel
    return [o.view(s.shape) for o, s in zip(out, sliced, strict=True)]


def _replicate_exchange(
    entries: Sequence[tuple[torch.Tensor, torch.Tensor, Route]],
    orthogonalize: Orthogonalize,
    dtype: torch.dtype,
) -> list[torch.Tensor]:
    """Each owner's Newton-Schulz of the whole matrices every rank holds (gathered first
    where they are sharded), then an all-gather of the results over the group."""
    split = entries[0][2].split
    n, me = split.size, split.index
    wholes = [
        gather_whole(param, update) if route.gathered else update
        for param, update, route in entries
    ]
    stacks = [w.reshape(math.prod(w.shape[:-2]), *w.shape[-2:]) for w in wholes]
    matrices = [(k, j) for k, stack in enumerate(stacks) for j in range(stack.shape[0])]
    owners = _owners([s.shape[0] for s in stacks], [tuple(s.shape[-2:]) for s in stacks], n)
    loads = [0] * n
    for (k, _), owner in zip(matrices, owners, strict=True):
        loads[owner] += stacks[k][0].numel()
    row = stacks[0].new_zeros(max(loads), dtype=torch.float32)
    start = 0
    for (k, j), owner in zip(matrices, owners, strict=True):
        if owner == me:
            result = _newton_schulz(stacks[k][j], wholes[k].ndim > 2, orthogonalize, dtype)
            row[start : start + result.numel()] = result.reshape(-1)
            start += result.numel()
    rows = _all_gather_rows(row, split)
    out = [torch.empty_like(stack, dtype=torch.float32) for stack in stacks]
    starts = [0] * n
    for (k, j), owner in zip(matrices, owners, strict=True):
        numel = stacks[k][0].numel()
        out[k][j] = rows[owner, starts[owner] : starts[owner] + numel].view(stacks[k].shape[1:])
        starts[owner] += numel
    results = []
    for (param, _, route), o, whole in zip(entries, out, wholes, strict=True):
        full = o.view(whole.shape)
        results.append(keep_local(param, full) if route.gathered else full)
    return results


def _all_gather_rows(row: torch.Tensor, split: SplitGroup) -> torch.Tensor:
    """Every rank's `row` of the split, [n, length], in the split's (row-major) order:
    gathered over the inner dim first, so each outer gather joins whole inner blocks."""
    rows = row[None]
    for group, size in zip(reversed(split.groups), reversed(split.sizes), strict=True):
        if size == 1:
            continue
        out = rows.new_empty(size * rows.shape[0], rows.shape[1])
        dist.all_gather_single(out, rows.contiguous(), group=group)
        rows = out
    return rows
