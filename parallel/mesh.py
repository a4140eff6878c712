"""One DeviceMesh for the whole job, dims outer->inner (pp, dp_replicate, dp_shard, tp).

TP is innermost so its ranks are consecutive and stay inside a node; the flattened `dp`
dim (dp_replicate x dp_shard) is the group that data-parallel reductions and the data
loader use.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from pretrain_core.layout import MESH_DIMS, Degrees


@dataclass(frozen=True)
class JobMesh:
    """The job's mesh and its flattened data-parallel dim."""

    world: DeviceMesh
    dp: DeviceMesh


def build_mesh(degrees: Degrees, device_type: str) -> JobMesh:
    """Create the job's mesh and its flattened `dp` dim; needs an initialized process group."""
    mesh = init_device_mesh(device_type, degrees.mesh_shape, mesh_dim_names=MESH_DIMS)
    # Flattening is private API but the supported way to name a group spanning two dims;
    # the flattened mesh is kept here because slicing it back out of the root is deprecated.
    dp = mesh["dp_replicate", "dp_shard"]._flatten("dp")
    return JobMesh(world=mesh, dp=dp)


def data_parallel_mesh(mesh: DeviceMesh, degrees: Degrees) -> DeviceMesh:
    """The mesh FSDP shards over: 2-D (replicate, shard) for hybrid sharding, else 1-D."""
    if degrees.dp_replicate > 1:
        return mesh["dp_replicate", "dp_shard"]
    return mesh["dp_shard"]
