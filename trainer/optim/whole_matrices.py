"""Whole matrices from a parameter's shards and back: what Muon's orthogonalization needs.

A parameter sharded by FSDP2 or tensor parallelism (a DTensor) is gathered over the mesh
dims that split its matrix dims; dims that only split a stack of experts (expert
parallelism) stay sharded, since each rank holds whole expert matrices.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor


def batch_shard(placement: Any, ndim: int) -> bool:
    """Whether `placement` shards a dim before the matrix dims (the experts of a stack)."""
    return type(placement) is Shard and placement.dim < ndim - 2


def splits_matrices(param: torch.Tensor) -> bool:
    """Whether some mesh dim of `param` (a DTensor) splits its matrices."""
    if not isinstance(param, DTensor):
        return False
    return not all(p.is_replicate() or batch_shard(p, param.ndim) for p in param.placements)


def _keep(param: DTensor) -> list[Any]:
    return [p if batch_shard(p, param.ndim) else Replicate() for p in param.placements]


def gather_whole(param: DTensor, local: torch.Tensor) -> torch.Tensor:
    """This rank's stack of whole matrices of a tensor laid out as `param`, from its local
    shard `local` (collective over `param`'s mesh)."""
    mesh, placements = param.device_mesh, param.placements
    whole = DTensor.from_local(
        local, mesh, placements, run_check=False, shape=param.shape, stride=param.stride()
    )
    if not any(batch_shard(p, param.ndim) for p in placements):
        return whole.full_tensor()
    return whole.redistribute(mesh, _keep(param)).to_local()


def keep_local(param: DTensor, whole: torch.Tensor) -> torch.Tensor:
    """This rank's shard of `whole` (what `gather_whole` returns) laid out as `param`: a
    slice, no communication."""
    mesh, placements = param.device_mesh, param.placements
    if not any(batch_shard(p, param.ndim) for p in placements):
        return distribute_tensor(whole, mesh, placements, src_data_rank=None).to_local()
    gathered = DTensor.from_local(
        whole, mesh, _keep(param), run_check=False, shape=param.shape, stride=param.stride()
    )
    # Replicate -> Shard keeps a local slice: no communication.
    return gathered.redistribute(mesh, placements).to_local()
