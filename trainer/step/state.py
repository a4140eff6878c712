"""What a step is: the state it trains, the micro-batches it takes, what it reports, and the
protocol every stepper (`LocalStep`, `PipelineStep`, `PipeDreamStep`) follows."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pretrain.parallel.context import ContextSplit
from pretrain.parallel.precision import LossScaler
from pretrain.trainer.observe import stability
from pretrain.trainer.step.chunked_loss import ChunkedLMLoss
from pretrain.trainer.step.mtp_loss import MultiTokenLoss
from pretrain.trainer.step.phases import OFF, StepPhases


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
    chunked_losses: tuple[ChunkedLMLoss, ...] = ()
    """The chunked losses inside `loss_fn` and `eval_loss_fn` (`train.loss_chunks` > 1 on the
    stage that holds the LM head), whose head PipeDream-2BW points at the running version."""
    phases: StepPhases = OFF
    """Times the step's forward, backward and optimizer (read by the metrics window)."""
    stability: stability.StabilityMonitor = stability.OFF
    """Handed the gradients and the update of a sampled step (`logging.stability_every`)."""
    routing_group: dist.ProcessGroup | None = None
    """The ranks that route tokens of their own (dp x cp), whose loads the MoE balancing
    biases and routing metrics sum (None: one rank)."""
    context: ContextSplit | None = None
    """Context parallelism: which chunks of each sequence this rank computes (None: all)."""
    stash: nn.Module | None = None
    """PipeDream-2BW: the other weight version (a stage view like `plain`, which is the
    newest); checkpoints save and restore both."""
    mtp: MultiTokenLoss | None = None
    """The multi-token prediction loss inside `loss_fn` (model.mtp_layers > 0, on every stage:
    the last computes it, all take part in its metrics)."""
    settle: Callable[[], None] | None = None
    """Called before a checkpoint is written, to bring the step to a state a checkpoint can
    hold (2BW drains its pipeline and applies the last gradient)."""


MicroBatches = list[tuple[torch.Tensor, torch.Tensor]]
"""This rank's (inputs, targets) of one optimizer step, one pair per micro-batch."""


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

    def score(self, micro_batches: MicroBatches) -> torch.Tensor:
        """[rows, 2]: each row's summed log-likelihood of its scored targets and how many of
        them were not the argmax (`trainer/step/scoring.py`), every row of this rank's
        `micro_batches` in order, on every rank of the pipeline (forward only)."""
        ...
