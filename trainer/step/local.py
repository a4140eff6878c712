"""One optimizer step: the LM loss, forward and backward over the accumulation micro-batches,
then unscale, clip, agree on bad steps, update and advance the LR schedule; and the
forward-only loss of validation micro-batches and scores of task rows.

A mixture-of-experts model closes its routing counts after the update (the balancing biases
move by the step's loads), and a dropless expert-parallel dispatch whose slots overflowed
runs the step's micro-batches again with larger slots (`parallel/expert.py`), so an update
never sees a dropped assignment.

Every stepper reads its run through one `StepContext` (`trainer/step/context.py`), which
holds the hooks they share. The pipelined steps (`trainer/step/pipeline.py`,
`trainer/step/pipedream.py`) run a schedule instead of the micro-batch loop and share
`apply_gradients` and the state's loss function with it.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pretrain.core.schema import RecipeConfig
from pretrain.parallel.clip import clip_grad_norm_
from pretrain.parallel.data_parallel import gradient_sync
from pretrain.parallel.expert import (
    add_router_losses,
    drop_routing_step,
    dropless_dispatch,
    finish_routing_step,
    reduce_expert_grads,
    release_router_losses,
    settle_slot_bounds,
)
from pretrain.parallel.pipeline.tied_embedding import head_copies
from pretrain.parallel.precision import after_optimizer_step
from pretrain.parallel.tensor import local_value
from pretrain.trainer.faults.step_guard import StepGuard
from pretrain.trainer.step.context import StepContext
from pretrain.trainer.step.state import MicroBatches, StepResult, TrainState

SLOT_RETRIES = 3
"""Runs of one step a dropless dispatch may take to size its slots (one rerun suffices: the
rerun routes exactly as the first run did)."""


def run_again_for_slots(state: TrainState, cfg: RecipeConfig, device: torch.device) -> bool:
    """After a step's backward: whether its dropless dispatch overflowed a slot, in which
    case the gradients and routing counts are cleared for a rerun with the grown slots."""
    if not dropless_dispatch(cfg.model, cfg.parallel):
        return False
    if not settle_slot_bounds(state.plain, cfg.model.n_layers, device):
        return False
    state.optimizer.zero_grad(set_to_none=True)
    drop_routing_step(state.plain)
    if state.mtp is not None:
        state.mtp.drop_step()
    if dist.get_rank() == 0:
        print(
            "[trainer] a dropless MoE dispatch slot overflowed: slots grown, step rerun", flush=True
        )
    return True


def train_step(ctx: StepContext, micro_batches: MicroBatches) -> StepResult:
    """One optimizer step over this rank's accumulation micro-batches.

    Returns this rank's mean loss, the global gradient norm (before clipping) and what all
    ranks agreed: (bad, stop). A bad step (non-finite loss or norm) applies no update, and
    under fp16 neither does a step whose gradients overflowed (the scale backs off). Without
    a guard (one-process tools and benchmarks) badness is decided locally and stop is False.
    """
    state = ctx.state
    for _ in range(SLOT_RETRIES):
        loss = _forward_backward(ctx, micro_batches)
        if not run_again_for_slots(state, ctx.cfg, ctx.device):
            break
    else:
        raise RuntimeError(f"the MoE dispatch slots overflowed {SLOT_RETRIES} runs of one step")
    with state.phases.phase("backward"):
        reduce_expert_grads(state.plain)
    with state.phases.phase("optimizer"):
        return StepResult(loss, *apply_gradients(state, ctx.cfg, ctx.guard, loss))


def _forward_backward(ctx: StepContext, micro_batches: MicroBatches) -> torch.Tensor:
    """Forward and backward of every micro-batch; returns this rank's mean loss."""
    state = ctx.state
    accum = len(micro_batches)
    loss_sum = torch.zeros((), device=ctx.device)
    for i, (inputs, targets) in enumerate(micro_batches):
        # Asynchronous from pinned memory (the prefetching loader pins on CUDA).
        inputs = inputs.to(ctx.device, non_blocking=True)
        targets = targets.to(ctx.device, non_blocking=True)
        kwargs = ctx.train_kwargs(inputs)
        inputs, targets = ctx.split(inputs, targets)
        with gradient_sync(state.model, enabled=i == accum - 1):
            with state.phases.phase("forward"), ctx.autocast():
                logits = state.model(inputs, **kwargs)
            with ctx.loss_parallel():
                with state.phases.phase("forward"):
                    loss = state.loss_fn(logits, targets)
                    objective = add_router_losses(loss, state.plain)
                with state.phases.phase("backward"):
                    state.scaler.scale_loss(objective / accum).backward()
                    release_router_losses(state.plain)
        # Every TP rank holds the same (replicated) loss.
        loss_sum += local_value(loss.detach())
    return ctx.context_mean(loss_sum / accum)


def _forward_only(
    ctx: StepContext,
    micro_batches: MicroBatches,
    measure: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> list[torch.Tensor]:
    """`measure(output, targets)` of each micro-batch, forward only (no gradient)."""
    state = ctx.state
    measured = []
    for inputs, targets in micro_batches:
        inputs, targets = inputs.to(ctx.device), targets.to(ctx.device)
        kwargs = ctx.model_kwargs(inputs)
        inputs, targets = ctx.split(inputs, targets)
        with ctx.autocast():
            output = state.model(inputs, **kwargs)
        with ctx.loss_parallel():
            measured.append(measure(output, targets))
    return measured


@torch.no_grad()
def eval_loss(ctx: StepContext, micro_batches: MicroBatches) -> torch.Tensor:
    """This rank's mean LM loss over `micro_batches`, forward only: no gradient, no update."""

    def loss(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # Every TP rank holds the same (replicated) loss.
        return local_value(ctx.state.eval_loss_fn(output, targets))

    total = torch.zeros((), device=ctx.device)
    for value in _forward_only(ctx, micro_batches, loss):
        total += value
    return ctx.context_mean(total / len(micro_batches))


@torch.no_grad()
def score_rows(ctx: StepContext, micro_batches: MicroBatches) -> torch.Tensor:
    """[rows, 2]: the task scores (`trainer/step/scoring.py`) of every row of this rank's
    `micro_batches`, in order, forward only."""
    return ctx.context_sum(torch.cat(_forward_only(ctx, micro_batches, ctx.row_scores)))


@dataclass
class LocalStep:
    """`train_step` of a layout without pipeline parallelism, bound to its run."""

    ctx: StepContext

    def step(self, micro_batches: MicroBatches) -> StepResult:
        """One optimizer step over this rank's micro-batches."""
        return train_step(self.ctx, micro_batches)

    def evaluate(self, micro_batches: MicroBatches) -> torch.Tensor:
        """This rank's mean validation loss over `micro_batches` (forward only)."""
        return eval_loss(self.ctx, micro_batches)

    def score(self, micro_batches: MicroBatches) -> torch.Tensor:
        """The task scores of every row of `micro_batches` (forward only)."""
        return score_rows(self.ctx, micro_batches)


def apply_gradients(
    state: TrainState,
    cfg: RecipeConfig,
    guard: StepGuard | None,
    loss: torch.Tensor,
    extra_group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, bool, bool]:
    """Unscale, clip and apply the accumulated gradients, then advance the LR schedule.

    Returns the global gradient norm before clipping (`extra_group` sums it over pipeline
    stages) and what all ranks agreed: (bad, stop). A bad step (non-finite loss or norm)
    applies no update, and under fp16 neither does a step whose gradients overflowed.
    """
    state.scaler.unscale_(state.plain.parameters())
    state.stability.gradients(state.plain)
    norm = clip_grad_norm_(
        state.plain.parameters(), cfg.optim.grad_clip, extra_group, head_copies(state.plain)
    )
    # An fp16 overflow is the loss scaler's to handle (back off and retry), not a fault.
    scaled_ok = state.scaler.update(norm)
    checked = norm if scaled_ok else torch.zeros_like(norm)
    if guard is None:
        bad, stop = not bool(torch.isfinite(loss) and torch.isfinite(checked)), False
    else:
        bad, stop = guard.agree(loss, checked)
    step_optimizer(state, cfg, update=scaled_ok and not bad)
    return norm, bad, stop


def step_optimizer(state: TrainState, cfg: RecipeConfig, update: bool) -> None:
    """Apply the (unscaled, clipped) gradients if `update`, then advance the LR schedule and
    clear the gradients: a skipped step still consumes its data and its place in the LR
    schedule. The MoE routing counts of the step close either way."""
    with state.stability.update(state.plain, applied=update):
        if update:
            state.optimizer.step()
            after_optimizer_step(state.plain, cfg.precision)
    finish_routing_step(state.plain, state.routing_group, update)
    if state.mtp is not None:
        state.mtp.end_step()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step", UserWarning)
        state.scheduler.step()
    state.optimizer.zero_grad(set_to_none=True)
