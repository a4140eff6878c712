"""Data parallelism: DDP (ZeRO-0), ZeRO-1 (sharded optimizer states) and ZeRO-2/3 (FSDP2).

- ZeRO-0: DistributedDataParallel over the flattened dp group.
- ZeRO-1: DDP plus a ZeroRedundancyOptimizer sharded over dp_shard (with dp_replicate > 1
  each replica group holds its own sharded copy: hybrid ZeRO-1).
- ZeRO-2/3: FSDP2 `fully_shard` per transformer block and on the root, over the (replicate,
  shard) mesh; ZeRO-3 reshards parameters after forward, ZeRO-2 keeps them unsharded until
  backward. BF16, FP16 and FP8 (bf16 outside its FP8 matmuls) use a MixedPrecisionPolicy
  with FP32 master weights and FP32 reduction.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from launcher.layout import Degrees
from launcher.schema import ParallelConfig, PrecisionConfig
from parallel.expert import expert_parameter_names, expert_parameters
from parallel.mesh import JobMesh, data_parallel_mesh
from parallel.precision import compute_dtype


def uses_fsdp(parallel: ParallelConfig, degrees: Degrees) -> bool:
    """Whether parameters are sharded by FSDP2 (ZeRO-2/3 with more than one dp rank)."""
    return parallel.zero >= 2 and degrees.dp > 1


def apply_fsdp(
    model: nn.Module,
    mesh: JobMesh,
    degrees: Degrees,
    parallel: ParallelConfig,
    precision: PrecisionConfig,
) -> None:
    """Shard each block and the root with FSDP2 (works on a meta-device model)."""
    mp_policy = MixedPrecisionPolicy()
    if compute_dtype(precision) is not None:
        mp_policy = MixedPrecisionPolicy(
            param_dtype=compute_dtype(precision), reduce_dtype=torch.float32
        )
    dp_mesh = data_parallel_mesh(mesh.world, degrees)
    reshard = parallel.zero == 3
    # Expert-parallel weights are reduced over their own ranks (parallel/expert.py).
    ignored = set(expert_parameters(model)) or None
    for block in model.layers.values():
        fully_shard(
            block,
            mesh=dp_mesh,
            reshard_after_forward=reshard,
            mp_policy=mp_policy,
            ignored_params=ignored,
        )
    # The root's parameters (embedding, final norm, head) are needed again right at the
    # start of backward, so resharding them after forward would only add an all-gather.
    fully_shard(
        model,
        mesh=dp_mesh,
        reshard_after_forward=False,
        mp_policy=mp_policy,
        ignored_params=ignored,
    )


def apply_ddp(model: nn.Module, mesh: JobMesh) -> nn.Module:
    """Wrap a materialized model in DDP over the flattened dp group (less expert weights)."""
    ignored = expert_parameter_names(model)
    if ignored:
        # Expert-parallel weights are reduced over their own ranks (parallel/expert.py).
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ignored)
    return DistributedDataParallel(model, process_group=mesh.dp.get_group())


def build_zero1_optimizer(
    param_groups: list[dict],
    optimizer_class: type[torch.optim.Optimizer],
    optimizer_kwargs: dict,
    mesh: JobMesh,
) -> torch.optim.Optimizer:
    """An optimizer whose states are sharded over dp_shard (ZeRO-1)."""
    return ZeroRedundancyOptimizer(
        param_groups,
        optimizer_class=optimizer_class,
        process_group=mesh.world["dp_shard"].get_group(),
        **optimizer_kwargs,
    )


@contextlib.contextmanager
def gradient_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Skip the data-parallel gradient reduction on non-final accumulation micro-batches."""
    if isinstance(model, DistributedDataParallel) and not enabled:
        with model.no_sync():
            yield
        return
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)
    yield
