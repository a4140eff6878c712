"""Activation recompute: none, full (every k-th block) or selective (keep matmul outputs);
the multi-token prediction modules' blocks under either policy.

The block's own `forward` is wrapped in `torch.utils.checkpoint` on the instance, so
parameter names stay those of the plain model (checkpoints do not depend on the policy)
and FSDP's hooks, which run around `forward`, stay outside the recomputed region.

Selective recompute keeps each matmul's output, except a row-parallel projection's under
tensor parallelism (attention `wo`, MLP `w2`): that output is a partial sum over the whole
sequence, and what the block goes on with is its reduction (a reduce-scatter over the
sequence under SP, an all-reduce without), which is kept instead. Under SP this keeps 1/tp
of the sequence where the partial sum would be whole; in either case the recomputation
issues no reduction again. The price is `wo`'s matmul, run again in the recomputation to
feed the kept reduction's place in the graph (`w2`'s is not: the recomputation stops once
its inputs are packed, the last tensors backward needs); `models/flops.py` counts it in HFU.
Values are unchanged: the kept reduction is the one the forward computed.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import (
    SAC_IGNORED_OPS,
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from pretrain.core.recompute import recomputed_blocks
from pretrain.core.schema import RecomputeConfig

# Matmul outputs are expensive to recompute and small next to the attention core and the
# elementwise activations, which selective recompute throws away (Korthikanti et al. 2022).
_SAVED_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
}
# Selective recompute replays the forward's ops by their count, and fails on an op the
# recomputation calls more or fewer times. FSDP's hooks of a unit nested in a recomputed
# block (routed experts sharded over their own group under EP with ZeRO) open profiler ranges
# around its forward, and skip its pre-forward in the recomputation (the pre-backward
# unshard did it): so their counts differ. They compute nothing; torch lets ops of that kind
# (detach, device queries) run as they come, and these join them.
SAC_IGNORED_OPS.update(
    {
        torch.ops.profiler._record_function_enter_new.default,
        torch.ops.profiler._record_function_exit.default,
        torch.ops.profiler._record_function_exit._RecordFunction,
    }
)
_SAVED_REDUCTIONS = {
    # What DTensor issues to turn a row-parallel projection's partial sums into the
    # residual stream's layout: sequence-sharded under SP, replicated without.
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    torch.ops._c10d_functional.all_reduce.default,
}


def _is_partial(output: object) -> bool:
    """Whether an op's output is a DTensor of partial sums (a row-parallel matmul's)."""
    return isinstance(output, DTensor) and any(p.is_partial() for p in output.placements)


def _save_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    if op in _SAVED_REDUCTIONS:
        return CheckpointPolicy.MUST_SAVE
    if op in _SAVED_OPS and not _is_partial(ctx.op_output):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _checkpointed(forward: Callable, context_fn: Callable | None) -> Callable:
    def run(*args, **kwargs):
        extra = {"context_fn": context_fn} if context_fn is not None else {}
        return checkpoint(forward, *args, use_reentrant=False, **extra, **kwargs)

    return run


def apply_recompute(model: nn.Module, cfg: RecomputeConfig) -> None:
    """Wrap the forward of the blocks `recomputed_blocks` selects, in place."""
    if cfg.policy == "none":
        return
    context_fn = (
        partial(create_selective_checkpoint_contexts, _save_matmuls)
        if cfg.policy == "selective"
        else None
    )
    # Global layer indices: a pipeline stage recomputes the blocks the full model would.
    for index in recomputed_blocks(cfg, model.cfg.n_layers):
        if str(index) in model.layers:
            block = model.layers[str(index)]
            block.forward = _checkpointed(block.forward, context_fn)
    # The multi-token prediction modules' blocks (on the last stage) are recomputed alike.
    for depth in (getattr(model, "mtp", None) or {}).values():
        depth.block.forward = _checkpointed(depth.block.forward, context_fn)
