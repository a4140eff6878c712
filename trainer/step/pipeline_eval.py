"""The validation loss and task scores of a pipelined run, under every schedule: this rank's
micro-batches forward only through its stage modules (`parallel/pipeline/forward_only.py`),
outside the training schedule, so it is the same pass under 1F1B, the V schedules and PipeDream-2BW.

The micro-batches are the training step's (this rank's batch split into
`parallel.pp_microbatches` equal parts), the loss is the plain one (the state's training
loss may be compiled or fault-injected; chunked as training's is), and the mean is on every
stage, as the training loss is. Task scores (`trainer/step/scoring.py`) take the same pass and
reach every stage as a sum over the pipeline (the other stages add zeros).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from pretrain.core.stages import placement, stage_ranks
from pretrain.parallel.pipeline.forward_only import forward_only
from pretrain.parallel.pipeline.stages import stage_indices
from pretrain.parallel.tensor import local_value
from pretrain.trainer.step.context import StepContext
from pretrain.trainer.step.state import MicroBatches


def _forward_pipeline(
    ctx: StepContext,
    chunks: Sequence[nn.Module],
    micro_batches: MicroBatches,
    measure: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> tuple[list[torch.Tensor], int]:
    """`measure(output, targets)` of each pipeline micro-batch on the last stage ([]
    elsewhere), and the rows of this rank's batch."""
    p = ctx.cfg.parallel
    inputs, targets = ctx.whole_batch(micro_batches)
    parts = ctx.pipeline_microbatches
    part_targets = torch.tensor_split(targets, parts)
    with ctx.loss_parallel():
        measured = forward_only(
            chunks,
            stage_indices(ctx.pipeline_rank, p),
            stage_ranks(p.pp, p.vpp, placement(p.pp_schedule)),
            torch.tensor_split(inputs, parts),
            ctx.microbatch_kwargs(ctx.whole_inputs(micro_batches)),
            lambda output, i: measure(output, part_targets[i]),
            ctx.pipeline_group,
            ctx.device,
        )
    return measured, inputs.shape[0]


@torch.no_grad()
def evaluate_pipeline(
    ctx: StepContext, chunks: Sequence[nn.Module], micro_batches: MicroBatches
) -> torch.Tensor:
    """The mean validation loss of this pipeline's `micro_batches` through `chunks` (this
    rank's stage modules, in model order), on every stage."""

    def loss(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # Every TP rank holds the same (replicated) loss.
        return local_value(ctx.state.eval_loss_fn(output, targets))

    losses, _ = _forward_pipeline(ctx, chunks, micro_batches, loss)
    return ctx.pipeline_mean(losses)


@torch.no_grad()
def score_pipeline(
    ctx: StepContext, chunks: Sequence[nn.Module], micro_batches: MicroBatches
) -> torch.Tensor:
    """[rows, 2]: the task scores of every row of this pipeline's `micro_batches` through
    `chunks`, in order, on every stage (the last stage's, summed over the pipeline)."""
    scores, rows = _forward_pipeline(ctx, chunks, micro_batches, ctx.row_scores)
    total = torch.cat(scores) if scores else torch.zeros(rows, 2, device=ctx.device)
    dist.all_reduce(total, group=ctx.pipeline_group)
    return ctx.context_sum(total)
