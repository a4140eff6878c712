"""The objective of multi-token prediction: the next-token loss plus `model.mtp_loss_weight`
times the mean over the D depths of each depth's loss (DeepSeek-V3's L_MTP); the step
reports the next-token loss, and each depth's loss as `mtp_loss_<k>`.

Given the input tokens (`StepContext.train_kwargs`), the model (or its last pipeline stage)
appends the depths' outputs to the next-token output along the batch (models/mtp.py), so
the loss of every stepper, the pipeline schedules' included, receives them in the one
output tensor it already takes. Depth k predicts, at position i, the target of position
i + k: the targets rolled left by k, whose last k positions hold the sequence's start and
are left out. Its loss is the mean over the b (s - k) positions kept: the sum over the
positions (of every chunk, under `train.loss_chunks`) divided by that count, so chunks that
hold the left-out positions weigh what they hold.

The depths' term joins the gradient without changing the reported value: `_WithGradient`
returns the next-token loss, and its backward sends the same gradient to the MTP term, as
if the two were added. Validation feeds the model no tokens ahead: its loss is the plain one.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from pretrain.parallel.tensor import local_value

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
IGNORED = -100
"""The target cross-entropy leaves out (its default `ignore_index`)."""


def lm_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy of logits [b, s, vocab] against targets [b, s] (those
    equal to IGNORED left out), in FP32."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")


def targets_ahead(targets: torch.Tensor, depth: int) -> torch.Tensor:
    """What depth `depth` predicts at each position: `targets` [b, s] rolled left by `depth`,
    the last `depth` positions IGNORED."""
    ahead = targets.roll(-depth, dims=1)
    ahead[:, -depth:] = IGNORED
    return ahead


class _WithGradient(torch.autograd.Function):
    """`loss` unchanged; its backward also gives `extra` the gradient `loss` gets."""

    @staticmethod
    def forward(ctx, loss: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
        return loss.view_as(loss)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grad, grad


class MultiTokenLoss:
    """The training loss of a model with `depths` MTP modules: `main` of the next-token
    output, plus `weight` times the mean over the depths of `ahead` (a sum over the kept
    positions) divided by the positions kept. Records each depth's loss for the metrics,
    which the pipeline group `pp_group` (if any) gathers from its last stage."""

    def __init__(
        self,
        main: LossFn,
        ahead: LossFn,
        depths: int,
        weight: float,
        pp_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.main = main
        self.ahead = ahead
        self.depths = depths
        self.weight = weight
        self.pp_group = pp_group
        self._step: list[torch.Tensor] = []
        self._last: torch.Tensor | None = None

    def __call__(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        b, s = targets.shape
        if output.shape[0] == b:
            return self.main(output, targets)  # no tokens ahead were given
        parts = output.split(b)
        loss = self.main(parts[0], targets)
        terms = [
            self.ahead(parts[k], targets_ahead(targets, k)) / (b * (s - k))
            for k in range(1, self.depths + 1)
        ]
        self._step.append(torch.stack([local_value(t.detach()) for t in terms]))
        extra = terms[0]
        for term in terms[1:]:
            extra = extra + term
        return _WithGradient.apply(loss, extra * (self.weight / self.depths))

    def end_step(self) -> None:
        """Close a step: its depths' losses (their mean over its micro-batches) are the ones
        `metrics` reports."""
        if self._step:
            self._last = torch.stack(self._step).mean(0)
        self._step = []

    def drop_step(self) -> None:
        """Forget the losses of a step that runs again."""
        self._step = []

    def metrics(self, device: torch.device, dp_group: dist.ProcessGroup) -> dict[str, float]:
        """`mtp_loss_<k>` of the last step, averaged over the data-parallel ranks (collective
        over `dp_group`, and over `pp_group`, whose last stage alone computes them)."""
        values = torch.zeros(self.depths, device=device)
        if self._last is not None:
            values += self._last
        if self.pp_group is not None:
            dist.all_reduce(values, group=self.pp_group)
        dist.all_reduce(values, group=dp_group)
        values /= dist.get_world_size(dp_group)
        return {f"mtp_loss_{k}": v for k, v in enumerate(values.tolist(), start=1)}
