"""What the run does about a bad step (`faults.on_nan`, `faults.on_spike`): the spike rule,
the audit log of every action, and what a rollback left for the steps after it.

A rollback reloads the newest checkpoint (step C) after a bad step S and moves the data on
to the batch after S's, so the batches of steps C+1..S are never trained on again; for
`faults.rollback_lr_steps` steps the learning rate is lowered. Every action is a line of
RUN_DIR/faults.jsonl (the file rewritten whole and renamed into place), which every rank
reads at start: a run that resumes from C again (it died before its next checkpoint) skips
the same batches and lowers the same steps' rate, so the data order does not depend on
where the run was interrupted.
"""

from __future__ import annotations

import json
import os
import statistics
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pretrain.core.inputs.reading import ReadError, json_objects
from pretrain.core.run.rundir import FAULTS_FILE as AUDIT_FILE


class SpikeRule:
    """A loss is a spike when it is above `factor` times the median of the last `window`
    losses that were kept (spikes and skipped steps do not enter the window)."""

    def __init__(self, factor: float, window: int) -> None:
        self.factor = factor
        self.losses: deque[float] = deque(maxlen=window)

    def median(self) -> float | None:
        """The running median, once the window is full."""
        full = len(self.losses) == self.losses.maxlen
        return statistics.median(self.losses) if full else None

    def is_spike(self, loss: float) -> bool:
        """Whether `loss` (finite) is a spike; a loss that is not enters the window."""
        median = self.median()
        if median is not None and loss > self.factor * median:
            return True
        self.losses.append(loss)
        return False

    def state_dict(self) -> dict[str, list[float]]:
        """The window, so that a resumed run judges its next steps as the run would have."""
        return {"losses": list(self.losses)}

    def load_state_dict(self, state: dict[str, list[float]]) -> None:
        self.losses.clear()
        self.losses.extend(float(x) for x in state["losses"])

    def load_absent(self) -> None:
        """A checkpoint written before the rule existed: start with an empty window."""
        self.losses.clear()


def read_audit(run_dir: Path) -> list[dict[str, Any]]:
    """The actions taken so far in this run ([] when none)."""
    path = Path(run_dir) / AUDIT_FILE
    if not path.exists():
        return []
    try:
        rows, _ = json_objects(path, "the run's faults.jsonl (one JSON object per line)")
    except ReadError:
        return []
    return rows


def write_audit(run_dir: Path, record: dict[str, Any]) -> None:
    """Add `record` to the audit log: the whole file is written beside it, synced and renamed
    over it, so a crash leaves the old log or the new one, never half a line."""
    path = Path(run_dir) / AUDIT_FILE
    text = "".join(json.dumps(row) + "\n" for row in [*read_audit(run_dir), record])
    tmp = path.with_suffix(".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


@dataclass(frozen=True)
class AfterRollback:
    """What the rollbacks of a run ask of the steps from `restored` on."""

    data_position: int | None
    """Where the data resumes (batches drawn), when the restored checkpoint is a rollback's
    target; None: where the checkpoint says."""
    lr_factor: float = 1.0
    lr_until: int = 0
    """Steps up to this one train at `lr_factor` times the scheduled rate."""


def after_rollbacks(audit: list[dict[str, Any]], restored: int) -> AfterRollback:
    """What a run resuming from the checkpoint of step `restored` keeps of the rollbacks in
    `audit`: the data position of the last rollback to that checkpoint (a checkpoint written
    after a rollback holds its own position), and a lowered rate not yet run out."""
    position: int | None = None
    factor, until = 1.0, 0
    for row in audit:
        if row.get("action") != "rollback":
            continue
        if row.get("to") == restored:
            position = int(row["data_position"])
        if int(row.get("lr_until", 0)) > restored:
            factor, until = float(row["lr_factor"]), int(row["lr_until"])
    return AfterRollback(position, factor, until)
