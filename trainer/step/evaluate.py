"""The validation loss: every `eval.every` steps and at the end of the run, forward only,
through the run's own step (so under the same DP, TP, PP and EP layout as training).

Each evaluation reads the same `eval.batches` global batches of validation sequences (in
order, split over the data-parallel ranks as training batches are), so successive values
are comparable and equal under every layout. val_ppl is exp(val_loss). A run that mixes
several sources, each with its validation split, also evaluates each split alone over as
many batches (val_loss_NAME). The MoE routing statistics of the metrics window are kept out
of it.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pretrain.models.moe import moe_modules
from pretrain.trainer.data.loader import DataLoader
from pretrain.trainer.step.state import Stepper


class Evaluator:
    """Decides when to evaluate and returns the validation metrics (empty when it did not)."""

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
        sources: dict[str, DataLoader] | None = None,
    ) -> None:
        """`sources`: each source's own validation loader, by its label in the metrics."""
        self.every = every if loader is not None else 0
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
        """{val_loss, val_ppl} when `step` is due (collective), else {}; a run asked to stop
        saves instead."""
        if stop or not self.due(step, last):
            return {}
        return self.evaluate()

    def evaluate(self) -> dict[str, Any]:
        """The mean loss over the validation batches, on every rank (collective); each
        source's own too, where `sources` holds them."""
        assert self.loader is not None
        saved = [(m.stats.totals, m.stats.forwards) for m in moe_modules(self.model)]
        loss = self._mean_loss(self.loader)
        per_source = {f"val_loss_{label}": self._mean_loss(s) for label, s in self.sources.items()}
        for module, (totals, forwards) in zip(moe_modules(self.model), saved, strict=True):
            module.stats.totals, module.stats.forwards = totals, forwards
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
