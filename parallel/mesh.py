"""One DeviceMesh for the whole job, dims outer->inner (pp, dp_replicate, dp_shard, tp).

TP is innermost so its ranks are consecutive and stay inside a node; the flattened `dp`
dim (dp_replicate x dp_shard) is the group that data-parallel reductions and the data
loader use.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from launcher.layout import Degrees

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")


def build_mesh(degrees: Degrees, device_type: str) -> DeviceMesh:
    """Create the job's mesh and its flattened `dp` dim; needs an initialized process group."""
    sizes = (degrees.pp, degrees.dp_replicate, degrees.dp_shard, degrees.tp)
    mesh = init_device_mesh(device_type, sizes, mesh_dim_names=MESH_DIMS)
    # Flattening is private API but the supported way to name a group spanning two dims.
    mesh["dp_replicate", "dp_shard"]._flatten("dp")
    return mesh


def data_parallel_mesh(mesh: DeviceMesh, degrees: Degrees) -> DeviceMesh:
    """The mesh FSDP shards over: 2-D (replicate, shard) for hybrid sharding, else 1-D."""
    if degrees.dp_replicate > 1:
        return mesh["dp_replicate", "dp_shard"]
    return mesh["dp_shard"]
