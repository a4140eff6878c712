"""One optimizer step: the LM loss, forward and backward over the accumulation micro-batches,
then unscale, clip, agree on bad steps, update and advance the LR schedule; and the
forward-only loss of validation micro-batches.

A mixture-of-experts model closes its routing counts after the update (the balancing biases
move by the step's loads), and a dropless expert-parallel dispatch whose slots overflowed
runs the step's micro-batches again with larger slots (`parallel/expert.py`), so an update
never sees a dropped assignment.

The pipelined step (`trainer/step/pipeline.py`) runs its schedule instead of the
micro-batch loop and shares `apply_gradients` and the state's loss function with it.
With `data.doc_mask` the model is given each position's document (`document_ids`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from parallel.clip import clip_grad_norm_
from parallel.context import ContextSplit
from parallel.data_parallel import gradient_sync, uses_fsdp
from parallel.expert import (
    add_router_losses,
    drop_routing_step,
    dropless_dispatch,
    finish_routing_step,
    reduce_expert_grads,
    settle_slot_bounds,
)
from parallel.pipeline.tied_embedding import head_copies
from parallel.precision import LossScaler, after_optimizer_step, forward_context
from parallel.tensor import local_value, vocab_parallel_loss
from pretrain_core.layout import Degrees
from pretrain_core.schema import RecipeConfig
from trainer.faults.step_guard import StepGuard
from trainer.step.phases import OFF, StepPhases


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of logits [b, s, vocab] against targets [b, s], in FP32."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


@dataclass
class TrainState:
    """What the loop steps: the (wrapped) model, the plain model inside, and optimization."""

    model: nn.Module
    plain: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: LossScaler
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = lm_loss
    """The training loss of the model's output (may be compiled, chunked, fault-injected)."""
    eval_loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = lm_loss
    """The plain loss of the model's output, for validation (chunked as training's is)."""
    phases: StepPhases = OFF
    """Times the step's forward, backward and optimizer (read by the metrics window)."""
    routing_group: dist.ProcessGroup | None = None
    """The data-parallel group whose loads the MoE balancing biases follow (None: one rank)."""
    context: ContextSplit | None = None
    """Context parallelism: which chunks of each sequence this rank computes (None: all)."""
    stash: nn.Module | None = None
    """PipeDream-2BW: the other weight version (a stage view like `plain`, which is the
    newest); checkpoints save and restore both."""
    settle: Callable[[], None] | None = None
    """Called before a checkpoint is written, to bring the step to a state a checkpoint can
    hold (2BW drains its pipeline and applies the last gradient)."""


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
    if dist.get_rank() == 0:
        print(
            "[trainer] a dropless MoE dispatch slot overflowed: slots grown, step rerun", flush=True
        )
    return True


MicroBatches = list[tuple[torch.Tensor, torch.Tensor]]
"""This rank's (inputs, targets) of one optimizer step, one pair per micro-batch."""


def document_ids(inputs: torch.Tensor, eos: int) -> torch.Tensor:
    """The document of each input position [b, s]: how many end-of-sequence tokens come
    before it (an EOS belongs to the document it ends; the token after starts the next)."""
    ends = (inputs == eos).to(torch.int32)
    return ends.cumsum(1) - ends


def model_kwargs(inputs: torch.Tensor, doc_eos: int | None) -> dict[str, torch.Tensor]:
    """The model's keyword arguments besides the tokens: the documents under doc_mask."""
    return {} if doc_eos is None else {"doc_ids": document_ids(inputs, doc_eos)}


class StepResult(NamedTuple):
    """What one optimizer step reports: this rank's mean loss, the global gradient norm
    before clipping, and what all ranks agreed: whether the step was bad (skipped) and
    whether the job was asked to stop."""

    loss: torch.Tensor
    grad_norm: torch.Tensor
    bad: bool
    stop: bool


class Stepper(Protocol):
    """Runs one optimizer step of the run's layout (`LocalStep`, `PipelineStep` or, under
    PipeDream-2BW, `PipeDreamStep`)."""

    def step(self, micro_batches: MicroBatches) -> StepResult: ...

    def evaluate(self, micro_batches: MicroBatches) -> torch.Tensor: ...


def _autocast(cfg: RecipeConfig, degrees: Degrees, device: torch.device):
    """Autocast where FSDP's mixed-precision policy does not already cast (and TE's FP8)."""
    return forward_context(cfg.precision, device, weights_cast=uses_fsdp(cfg.parallel, degrees))


def train_step(
    state: TrainState,
    micro_batches: MicroBatches,
    cfg: RecipeConfig,
    degrees: Degrees,
    device: torch.device,
    guard: StepGuard | None = None,
    doc_eos: int | None = None,
) -> StepResult:
    """One optimizer step over this rank's accumulation micro-batches.

    Returns this rank's mean loss, the global gradient norm (before clipping) and what all
    ranks agreed: (bad, stop). A bad step (non-finite loss or norm) applies no update, and
    under fp16 neither does a step whose gradients overflowed (the scale backs off). Without
    a `guard` (one-process tools and benchmarks) badness is decided locally and stop is False.
    `doc_eos` (the end-of-sequence id) turns on document-aware attention.
    """
    for _ in range(SLOT_RETRIES):
        loss = _forward_backward(state, micro_batches, cfg, degrees, device, doc_eos)
        if not run_again_for_slots(state, cfg, device):
            break
    else:
        raise RuntimeError(f"the MoE dispatch slots overflowed {SLOT_RETRIES} runs of one step")
    with state.phases.phase("backward"):
        reduce_expert_grads(state.plain)
    with state.phases.phase("optimizer"):
        return StepResult(loss, *apply_gradients(state, cfg, guard, loss))


def _forward_backward(
    state: TrainState,
    micro_batches: MicroBatches,
    cfg: RecipeConfig,
    degrees: Degrees,
    device: torch.device,
    doc_eos: int | None,
) -> torch.Tensor:
    """Forward and backward of every micro-batch; returns this rank's mean loss."""
    accum = len(micro_batches)
    loss_sum = torch.zeros((), device=device)
    for i, (inputs, targets) in enumerate(micro_batches):
        # Asynchronous from pinned memory (the prefetching loader pins on CUDA).
        inputs = inputs.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        if state.context is not None:
            inputs, targets = state.context.shard(inputs), state.context.shard(targets)
        with gradient_sync(state.model, enabled=i == accum - 1):
            with state.phases.phase("forward"), _autocast(cfg, degrees, device):
                logits = state.model(inputs, **model_kwargs(inputs, doc_eos))
            with vocab_parallel_loss(enabled=degrees.tp > 1):
                with state.phases.phase("forward"):
                    loss = state.loss_fn(logits, targets)
                    objective = add_router_losses(loss, state.plain)
                with state.phases.phase("backward"):
                    state.scaler.scale_loss(objective / accum).backward()
        # Every TP rank holds the same (replicated) loss.
        loss_sum += local_value(loss.detach())
    loss = loss_sum / accum
    # Context-parallel ranks each hold two chunks of every sequence: the loss is their mean.
    return state.context.mean(loss) if state.context is not None else loss


@torch.no_grad()
def eval_loss(
    state: TrainState,
    micro_batches: MicroBatches,
    cfg: RecipeConfig,
    degrees: Degrees,
    device: torch.device,
    doc_eos: int | None = None,
) -> torch.Tensor:
    """This rank's mean LM loss over `micro_batches`, forward only: no gradient, no update."""
    total = torch.zeros((), device=device)
    for inputs, targets in micro_batches:
        inputs, targets = inputs.to(device), targets.to(device)
        if state.context is not None:
            inputs, targets = state.context.shard(inputs), state.context.shard(targets)
        with _autocast(cfg, degrees, device):
            logits = state.model(inputs, **model_kwargs(inputs, doc_eos))
        with vocab_parallel_loss(enabled=degrees.tp > 1):
            total += local_value(state.eval_loss_fn(logits, targets))
    loss = total / len(micro_batches)
    return state.context.mean(loss) if state.context is not None else loss


@dataclass
class LocalStep:
    """`train_step` of a layout without pipeline parallelism, bound to its run."""

    state: TrainState
    cfg: RecipeConfig
    degrees: Degrees
    device: torch.device
    guard: StepGuard | None = None
    doc_eos: int | None = None
    """The end-of-sequence id when data.doc_mask is on."""

    def step(self, micro_batches: MicroBatches) -> StepResult:
        """One optimizer step over this rank's micro-batches."""
        return train_step(
            self.state,
            micro_batches,
            self.cfg,
            self.degrees,
            self.device,
            self.guard,
            self.doc_eos,
        )

    def evaluate(self, micro_batches: MicroBatches) -> torch.Tensor:
        """This rank's mean validation loss over `micro_batches` (forward only)."""
        return eval_loss(
            self.state, micro_batches, self.cfg, self.degrees, self.device, self.doc_eos
        )


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
    if update:
        state.optimizer.step()
        after_optimizer_step(state.plain, cfg.precision)
    finish_routing_step(state.plain, state.routing_group, update)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step", UserWarning)
        state.scheduler.step()
    state.optimizer.zero_grad(set_to_none=True)
