"""The validation loss: every `eval.every` steps and at the end of the run, forward only,
through the run's own step (so under the same DP, TP, PP and EP layout as training); and
the downstream tasks when theirs are due (`trainer/evals/`), through the same step.

Each evaluation reads the same `eval.batches` global batches of validation sequences (in
order, split over the data-parallel ranks as training batches are), so successive values
are comparable and equal under every layout. val_ppl is exp(val_loss). A run that mixes
several sources, each with its validation split, also evaluates each split alone over as
many batches (val_loss_NAME). The MoE routing statistics of the metrics window are kept out
of it.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pretrain.models.moe import moe_modules
from pretrain.trainer.data.loader import DataLoader
from pretrain.trainer.evals.tasks import TaskEvaluator
from pretrain.trainer.step.state import Stepper


@contextlib.contextmanager
def routing_stats_kept(model: nn.Module) -> Iterator[None]:
    """Leave the MoE routing statistics of the metrics window as they were: evaluation
    forwards route tokens too, and must not count as training's."""
    saved = [(m.stats.totals, m.stats.forwards) for m in moe_modules(model)]
    try:
        yield
    finally:
        for module, (totals, forwards) in zip(moe_modules(model), saved, strict=True):
            module.stats.totals, module.stats.forwards = totals, forwards


class Evaluator:
    """Decides when to evaluate and returns the validation and task metrics (empty when it
    did not)."""

    def __init__(
        self,
        every: int,
        batches: int,
        stepper: Stepper,
        loader: DataLoader | None,
        *,
        dp_group: dist.ProcessGroup,
        model: nn.Module,
        device: torch.device,
        tasks: TaskEvaluator | None = None,
        sources: dict[str, DataLoader] | None = None,
    ) -> None:
        """`sources`: each source's own validation loader, by its label in the metrics."""
        self.every = every if loader is not None else 0
        self.tasks = tasks or TaskEvaluator(0, [], lambda requests: [])
        self.sources = sources or {}
        self.batches = batches
        self.stepper = stepper
        self.loader = loader
        self.dp_group = dp_group
        self.model = model
        self.device = device

    def due(self, step: int, last: bool) -> bool:
        """Whether `step` is evaluated: every `every` steps and the run's last one."""
        return self.every > 0 and (step % self.every == 0 or last)

    def after_step(self, step: int, last: bool, stop: bool) -> dict[str, Any]:
        """{val_loss, val_ppl} when `step` is due, and the tasks' metrics when theirs are
        (collective), else {}; a run asked to stop saves instead."""
        val, tasks = self.due(step, last), self.tasks.due(step, last)
        if stop or not (val or tasks):
            return {}
        with routing_stats_kept(self.model):
            return {**(self.evaluate() if val else {}), **(self.tasks.evaluate() if tasks else {})}

    def evaluate(self) -> dict[str, Any]:
        """The mean loss over the validation batches, on every rank (collective); each
        source's own too, where `sources` holds them."""
        assert self.loader is not None
        loss = self._mean_loss(self.loader)
        per_source = {f"val_loss_{label}": self._mean_loss(s) for label, s in self.sources.items()}
        if loss is None:
            return {"val_loss": None, "val_ppl": None, **per_source}
        return {"val_loss": loss, "val_ppl": math.exp(min(loss, 700.0)), **per_source}

    def _mean_loss(self, loader: DataLoader) -> float | None:
        """The mean loss over `loader`'s first batches, on every rank (collective); None
        when it is not finite."""
        total = torch.zeros((), device=self.device)
        for batch in range(self.batches):
            total += self.stepper.evaluate(loader.batches(batch))
        dist.all_reduce(total, group=self.dp_group)
        loss = total.item() / (self.batches * dist.get_world_size(self.dp_group))
        return loss if math.isfinite(loss) else None
