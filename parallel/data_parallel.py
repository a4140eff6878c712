"""Data parallelism: DDP (ZeRO-0), ZeRO-1 (sharded optimizer states) and ZeRO-2/3 (FSDP2).

- ZeRO-0 (and ZeRO-1's reduction): DistributedDataParallel over the flattened dp x cp
  group; with tensor or pipeline parallelism, FSDP2's `replicate` over the same group
  instead (DDP takes neither TP's DTensor weights nor a pipeline schedule driving its
  backward): the same arithmetic, every gradient all-reduced once per step, the weights
  whole on every replica.
- ZeRO-1: ZeRO-0's reduction plus optimizer states sharded over dp_shard
  (`parallel/zero/sharded_optimizer.py`; with dp_replicate > 1 each replica group holds its
  own sharded copy: hybrid ZeRO-1), routed experts' over the ranks holding the same experts.
- ZeRO-2/3: FSDP2 `fully_shard` per transformer block and on the root, over the (replicate,
  shard) mesh; ZeRO-3 reshards parameters after forward, ZeRO-2 keeps them unsharded until
  backward, and between accumulation micro-batches (one all-gather per step). BF16, FP16
  and FP8 (bf16 outside its FP8 matmuls) use a MixedPrecisionPolicy with FP32 master
  weights and FP32 reduction. Expert-parallel experts are their own FSDP2
  unit inside their block, over the `edp` ranks that hold the same experts, sharded along
  the model width (dim 0 is the experts, already split by ep, often one per rank; the hidden
  width may be split by etp), their reduce-scatter
  divided by dp rather than edp (parallel/expert.py says why); with a single such rank
  (dp = ep) they stay outside FSDP.

Overlap: FSDP2 issues the all-gathers of the next `parallel.fsdp_prefetch` blocks ahead
(forward and backward); DDP reduces buckets of `parallel.ddp_bucket_mb` while backward
continues. `precision.reduce_dtype=bf16` halves the reduction traffic under both.
`parallel.offload=params` keeps the shards in host memory (`parallel/zero/offload.py`).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard
from torch.nn.parallel import DistributedDataParallel

from pretrain.core.layout import Degrees
from pretrain.core.schema import ParallelConfig, PrecisionConfig
from pretrain.parallel.expert import (
    expert_parameter_names,
    expert_parameters,
    expert_replicas,
    expert_width_dims,
)
from pretrain.parallel.mesh import JobMesh
from pretrain.parallel.precision import compute_dtype
from pretrain.parallel.zero.offload import offload_policy
from pretrain.parallel.zero.sharded_optimizer import ShardedOptimizer

REDUCE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_GATHERED_ONCE: weakref.WeakSet[nn.Module] = weakref.WeakSet()
"""ZeRO-2 roots: their blocks stay unsharded from the step's first forward to its last
backward (FSDP2 reshards after backward only on the micro-batch that syncs)."""


def replicates_with_fsdp(parallel: ParallelConfig, degrees: Degrees) -> bool:
    """Whether ZeRO-0 (and ZeRO-1's reduction) runs on FSDP2's `replicate` rather than DDP:
    with more than one rank reducing gradients, under tensor parallelism (DTensor weights,
    which DDP cannot reduce) or pipeline parallelism (whose schedule drives backward in a
    way DDP's reducer refuses from the second step)."""
    return parallel.zero <= 1 and degrees.grad_replicas > 1 and (degrees.tp > 1 or degrees.pp > 1)


def apply_replicate(model: nn.Module, mesh: JobMesh, precision: PrecisionConfig) -> None:
    """ZeRO-0 over FSDP2's `replicate` (works on a meta-device model): each block and the
    root all-reduce their gradients over dp x cp after the step's last micro-batch. The
    weights stay FP32 (autocast casts them, as under DDP); experts are reduced by
    parallel/expert.py over their own ranks."""
    # Imported here: only layouts with TP or PP and DDP use it.
    from torch.distributed._composable.replicate_with_fsdp import replicate

    policy = MixedPrecisionPolicy(reduce_dtype=REDUCE_DTYPES[precision.reduce_dtype])
    ignored = set(expert_parameters(model)) or None
    blocks = [model.layers[key] for key in sorted(model.layers.keys(), key=int)]
    for unit in [*blocks, model]:
        replicate(unit, mesh=mesh.dp_cp, mp_policy=policy, ignored_params=ignored)


def apply_fsdp(
    model: nn.Module,
    mesh: JobMesh,
    parallel: ParallelConfig,
    precision: PrecisionConfig,
) -> None:
    """Shard each block and the root with FSDP2 (works on a meta-device model)."""
    mp_policy = MixedPrecisionPolicy(
        param_dtype=compute_dtype(precision),
        reduce_dtype=REDUCE_DTYPES[precision.reduce_dtype],
    )
    dp_mesh = mesh.fsdp
    offload = offload_policy(parallel, dp_mesh.device_type)
    reshard = parallel.zero == 3
    width_dims = expert_width_dims(model)
    for experts, replicas in expert_replicas(model):
        # With one rank per set of experts there is nothing to shard: they stay outside
        # FSDP and are reduced by parallel/expert.py, as under DDP.
        if replicas.mesh.size() == 1:
            continue
        fully_shard(
            experts,
            mesh=replicas.mesh,
            reshard_after_forward=reshard,
            # Along the model width: dim 0 may hold a single expert, and etp splits the
            # hidden width.
            shard_placement_fn=lambda param: Shard(width_dims[id(param)]),
            mp_policy=mp_policy,
        )
        experts.set_gradient_divide_factor(float(replicas.dp))
        # A sum, then the division: the premultiplied sum a custom factor asks for is NCCL's.
        experts.set_force_sum_reduction_for_comms(True)
        replicas.fsdp = True
    ignored = set(expert_parameters(model)) or None
    blocks = [model.layers[key] for key in sorted(model.layers.keys(), key=int)]
    # Each multi-token prediction module is a unit of its own, after the blocks.
    blocks += list(model.mtp.values()) if getattr(model, "mtp", None) is not None else []
    for block in blocks:
        fully_shard(
            block,
            mesh=dp_mesh,
            reshard_after_forward=reshard,
            mp_policy=mp_policy,
            offload_policy=offload,
            ignored_params=ignored,
        )
    if parallel.zero == 2:
        _GATHERED_ONCE.add(model)
    # The root's parameters (embedding, final norm, head) are needed again right at the
    # start of backward, so resharding them after forward would only add an all-gather.
    fully_shard(
        model,
        mesh=dp_mesh,
        reshard_after_forward=False,
        mp_policy=mp_policy,
        offload_policy=offload,
        ignored_params=ignored,
    )
    set_fsdp_prefetch(blocks, parallel.fsdp_prefetch)


def set_fsdp_prefetch(blocks: list[nn.Module], depth: int) -> None:
    """Each sharded block all-gathers the next `depth` blocks' parameters when its own forward
    (or, in reverse order, backward) starts; 0 keeps FSDP2's implicit one-block prefetch."""
    if depth == 0:
        return
    for i, block in enumerate(blocks):
        ahead = blocks[i + 1 : i + 1 + depth]
        behind = blocks[max(0, i - depth) : i][::-1]
        if ahead:
            block.set_modules_to_forward_prefetch(ahead)
        if behind:
            block.set_modules_to_backward_prefetch(behind)


def apply_ddp(
    model: nn.Module, mesh: JobMesh, parallel: ParallelConfig, precision: PrecisionConfig
) -> nn.Module:
    """Wrap a materialized model in DDP over the flattened dp x cp group, with the recipe's
    bucket size and reduction dtype (less expert weights, reduced over their own ranks)."""
    ignored = expert_parameter_names(model)
    if ignored:
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ignored)
    group = mesh.dp_cp.get_group()
    ddp = DistributedDataParallel(model, process_group=group, bucket_cap_mb=parallel.ddp_bucket_mb)
    if precision.reduce_dtype == "bf16":
        ddp.register_comm_hook(group, bf16_reduce_hook)
    return ddp


def ddp_bucket_bytes(model: nn.Module) -> int:
    """Bytes of the gradient buckets DDP allocated for `model` (0 when not DDP)."""
    if not isinstance(model, DistributedDataParallel):
        return 0
    sizes = model._get_ddp_logging_data().get("bucket_sizes", "")
    return sum(int(size) for size in str(sizes).split(",") if size.strip())


# `bucket` and the return value are left unannotated: DDP compares the annotations with the
# real classes, and postponed (string) annotations would fail that check.
def bf16_reduce_hook(group: dist.ProcessGroup, bucket):
    """DDP comm hook: average a gradient bucket in bf16, then copy it back in its own dtype
    (returns the future of that bucket).

    PyTorch's own bf16 hook is NCCL-only; this one runs on any backend with bf16 all-reduce
    (gloo included).
    """
    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16).div_(group.size())
    work = dist.all_reduce(compressed, group=group, async_op=True)

    def decompress(_: torch.futures.Future) -> torch.Tensor:
        buffer.copy_(compressed)  # reduced in place
        return buffer

    return work.get_future().then(decompress)


def build_zero1_optimizer(
    param_groups: list[dict],
    optimizer_class: type[torch.optim.Optimizer],
    optimizer_kwargs: dict,
    mesh: JobMesh,
    model: nn.Module,
) -> ShardedOptimizer:
    """An optimizer whose states are sharded over dp_shard (ZeRO-1); routed experts' over
    the ranks that hold the same experts."""
    dense = mesh.world["dp_shard"].get_group()
    experts = {
        id(p): replicas.mesh.get_group()
        for module, replicas in expert_replicas(model)
        for p in module.parameters()
    }
    return ShardedOptimizer(
        param_groups,
        optimizer_class,
        optimizer_kwargs,
        group_of=lambda param: experts.get(id(param), dense),
    )


def is_zero1_optimizer(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer` is ZeRO-1's sharded one."""
    return isinstance(optimizer, ShardedOptimizer)


@contextlib.contextmanager
def gradient_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Skip the data-parallel gradient reduction on non-final accumulation micro-batches."""
    if isinstance(model, DistributedDataParallel) and not enabled:
        with model.no_sync():
            yield
        return
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)
        if model in _GATHERED_ONCE:
            # ZeRO-2: keep the blocks unsharded between accumulation micro-batches, so that
            # the parameters are all-gathered once per step (the planner costs it so).
            model.set_reshard_after_backward(enabled)
    yield
