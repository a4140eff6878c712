"""One mesh object for the whole job: it owns the resolved degrees, the DeviceMesh with dims
outer->inner (pp, dp_replicate, dp_shard, cp, tp), the flattened dims, and the expert mesh.
`parallel/` and `trainer/` read degrees and groups from it and from nowhere else.

TP is innermost so its ranks are consecutive and stay inside a node, and CP next to it. The
flattened `dp` dim (dp_replicate x dp_shard) is the group the data loader splits sequences
over; `dp_cp` adds the cp ranks, which read the same sequences (each its own chunks) and
hold the same weights, so gradients are reduced over it (DDP) and FSDP shards over
dp_shard x cp (hybrid sharding: replicated over dp_replicate). The experts have a mesh of
their own over the same ranks: expert parallelism carves its ep ranks out of dp and expert
tensor parallelism its etp ranks out of tp, so the expert mesh is (pp, edp, ep, ep_tp, etp),
where edp = dp / ep x cp joins the ranks that hold the same expert shards and reduce their
gradients (the cp ranks of a sequence hold the same weights, experts included) and ep_tp =
tp / etp the ranks of a tp group that hold the same shards and compute the same thing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from pretrain.core.layout import MESH_DIMS, Degrees

EXPERT_MESH_DIMS = ("ep_pp", "edp", "ep", "ep_tp", "etp")


@dataclass(frozen=True)
class JobMesh:
    """The job's degrees, its mesh, the flattened dims the data-parallel modules use, and
    the expert mesh."""

    degrees: Degrees
    """The resolved degrees of the layout (dp_shard=-1 filled from the world size)."""
    world: DeviceMesh
    dp: DeviceMesh
    """Ranks that read different sequences (dp_replicate x dp_shard)."""
    dp_cp: DeviceMesh
    """Ranks that reduce each gradient together (dp x cp); `dp` when cp = 1."""
    fsdp: DeviceMesh
    """What FSDP shards over: (replicate, shard) for hybrid sharding, else 1-D; the shard
    dim is dp_shard x cp."""
    expert: DeviceMesh | None = None
    """The (pp, dp / ep x cp, ep, tp / etp, etp) mesh MoE layers shard their experts over
    (`ep` and `etp`) and keep their replicas on (`edp`); None when ep = etp = 1."""


def build_mesh(degrees: Degrees, device_type: str) -> JobMesh:
    """Create the job's mesh and its flattened dims; needs an initialized process group."""
    mesh = init_device_mesh(device_type, degrees.mesh_shape, mesh_dim_names=MESH_DIMS)
    # Flattening is private API but the supported way to name a group spanning two dims;
    # the flattened meshes are kept here because slicing them back out of the root is
    # deprecated.
    dp = mesh["dp_replicate", "dp_shard"]._flatten("dp")
    if degrees.cp == 1:
        dp_cp, fsdp = dp, _fsdp_mesh(mesh, degrees)
    else:
        dp_cp = mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")
        if degrees.dp_replicate > 1:
            # dp_shard and cp are adjacent, so (replicate, shard x cp) is dp_cp reshaped.
            shape = (degrees.dp_replicate, degrees.dp_shard * degrees.cp)
            fsdp = dp_cp._unflatten(0, shape, ("fsdp_replicate", "dp_shard_cp"))
        else:
            fsdp = mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    expert = _expert_mesh(degrees, device_type) if max(degrees.ep, degrees.etp) > 1 else None
    return JobMesh(degrees=degrees, world=mesh, dp=dp, dp_cp=dp_cp, fsdp=fsdp, expert=expert)


def _expert_mesh(degrees: Degrees, device_type: str) -> DeviceMesh:
    return DeviceMesh(device_type, expert_mesh_ranks(degrees), mesh_dim_names=EXPERT_MESH_DIMS)


def expert_mesh_ranks(degrees: Degrees) -> torch.Tensor:
    """The global ranks of the expert mesh, (pp, edp, ep, ep_tp, etp): ep splits the dp index
    (inner, so an ep group shares its cp and tp index), edp joins the rest of dp with cp, and
    etp splits the tp index (inner: consecutive ranks), ep_tp counting its chunks."""
    d = degrees
    ranks = torch.arange(d.world).view(d.pp, d.dp // d.ep, d.ep, d.cp, d.tp // d.etp, d.etp)
    return ranks.transpose(2, 3).reshape(d.pp, d.dp // d.ep * d.cp, d.ep, d.tp // d.etp, d.etp)


def _fsdp_mesh(mesh: DeviceMesh, degrees: Degrees) -> DeviceMesh:
    """The mesh FSDP shards over without cp: 2-D (replicate, shard) for hybrid sharding."""
    if degrees.dp_replicate > 1:
        return mesh["dp_replicate", "dp_shard"]
    return mesh["dp_shard"]
