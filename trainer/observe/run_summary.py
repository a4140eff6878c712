"""The block the main rank prints when a run reaches `train.steps`: what it trained, how well,
how long it took, where the weights are and what to run next.

The figures cover the whole run, not only the last job: the metrics of earlier jobs (before a
resume or requeue) are read back from RUN_DIR/metrics.jsonl when the logger opens it.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pretrain.core.inputs.reading import json_objects, number
from pretrain.core.run.durations import format_duration
from pretrain.core.run.goodput import Breakdown


@dataclass
class RunSummary:
    """The run's figures so far, fed one logged metrics row at a time."""

    last_step: int = 0
    last_loss: float | None = None
    last_val: float | None = None
    best_val: float | None = None
    best_val_step: int = 0

    def observe(self, step: int, metrics: dict[str, Any]) -> None:
        """Take in the metrics logged at `step`."""
        self.last_step = max(self.last_step, step)
        loss = number(metrics.get("loss"))
        if loss is not None:
            self.last_loss = loss
        val = number(metrics.get("val_loss"))
        if val is not None:
            self.last_val = val
            if self.best_val is None or val < self.best_val:
                self.best_val, self.best_val_step = val, step

    def read_history(self, metrics_file: Path) -> None:
        """Take in the rows earlier jobs of this run wrote; rows that are not an object with a
        whole step number (a line cut by a crash, a hand edit) are skipped."""
        if not metrics_file.is_file():
            return
        rows, _ = json_objects(metrics_file, "the run's metrics.jsonl")
        for row in rows:
            if type(row.get("step")) is int:
                self.observe(row["step"], row)

    def lines(
        self,
        *,
        tokens: int,
        wall_s: float,
        checkpoint: Path | None,
        run_dir: Path,
        goodput: Breakdown | None = None,
    ) -> list[str]:
        """The summary block: `tokens` trained in the whole run, `wall_s` of this job, and
        where the whole run's wall time went (`goodput`, every job of it)."""

        def loss(value: float | None) -> str:
            return "n/a" if value is None else f"{value:.4f}"

        quoted = shlex.quote(str(run_dir))
        export_dir = shlex.quote(f"{run_dir}-hf")  # beside the run dir, which it does not own
        best = loss(self.best_val)
        if self.best_val is not None:
            best += f" at step {self.best_val_step}"
        lines = [
            f"run finished: {self.last_step} steps, {tokens:,} tokens, "
            f"this job {format_duration(wall_s)}",
            f"  train loss {loss(self.last_loss)} | val loss {loss(self.last_val)} (best {best})",
            *([f"  {goodput.line()}"] if goodput is not None else []),
            f"  checkpoint: {checkpoint if checkpoint is not None else 'none written'}",
            f"  status:  pretrain status {quoted}",
            f"  report:  pretrain report {quoted}",
        ]
        if checkpoint is not None:
            lines.append(f"  export:  pretrain export {quoted} {export_dir}")
        return lines
