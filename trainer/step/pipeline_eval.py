"""The validation loss of a pipelined run, under every schedule: this rank's micro-batches
forward only through its stage modules (`parallel/pipeline/forward_only.py`), outside the
training schedule, so it is the same pass under 1F1B, the V schedules and PipeDream-2BW.

The micro-batches are the training step's (this rank's batch split into
`parallel.pp_microbatches` equal parts), the loss is the plain one (the state's training
loss may be compiled or fault-injected; chunked as training's is), and the mean is on every
stage, as the training loss is.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from pretrain.core.stages import placement, stage_ranks
from pretrain.parallel.pipeline.forward_only import forward_only
from pretrain.parallel.pipeline.stages import stage_indices
from pretrain.parallel.tensor import local_value
from pretrain.trainer.step.context import StepContext
from pretrain.trainer.step.state import MicroBatches


@torch.no_grad()
def evaluate_pipeline(
    ctx: StepContext, chunks: Sequence[nn.Module], micro_batches: MicroBatches
) -> torch.Tensor:
    """The mean validation loss of this pipeline's `micro_batches` through `chunks` (this
    rank's stage modules, in model order), on every stage."""
    p = ctx.cfg.parallel
    inputs, targets = ctx.whole_batch(micro_batches)
    parts = ctx.pipeline_microbatches
    part_targets = torch.tensor_split(targets, parts)

    def loss_of(output: torch.Tensor, i: int) -> torch.Tensor:
        # Every TP rank holds the same (replicated) loss.
        return local_value(ctx.state.eval_loss_fn(output, part_targets[i]))

    with ctx.loss_parallel():
        losses = forward_only(
            chunks,
            stage_indices(ctx.pipeline_rank, p),
            stage_ranks(p.pp, p.vpp, placement(p.pp_schedule)),
            torch.tensor_split(inputs, parts),
            ctx.microbatch_kwargs(inputs),
            loss_of,
            ctx.pipeline_group,
            ctx.device,
        )
    return ctx.pipeline_mean(losses)
