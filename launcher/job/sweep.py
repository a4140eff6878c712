"""Sweeps (`-m`): every point runs, whatever the others did, and feeds the sweeper.

Hydra stops a sweep at the first point that raises, and a sweeper plugin (Optuna, Ax)
needs a number from each point. So each point runs inside `run_point`: a failure is
reported and recorded, and the point returns the worst value for the sweeper's direction
(+inf when minimizing: Optuna refuses NaN, and a failed trial would stop its sweep); a
point that trained returns its final validation loss, or its final training loss when the
run has no validation. After the sweep `summary` lists every point's outcome and
the command exits non-zero if any failed. A stop asked by the user (Ctrl-C, SIGTERM) stops
the whole sweep.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from pretrain.core.inputs.reading import json_objects
from pretrain.core.run.rundir import METRICS_FILE
from pretrain.launcher.output import get_logger

LOG = get_logger(__name__)


class Stopped(SystemExit):
    """The user stopped the run (a signal): the whole sweep stops with it."""


class Failed(SystemExit):
    """The command failed with `code`; `message` (already printed) says why."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(code)
        self.message = message


@dataclass(frozen=True)
class Outcome:
    """How one sweep point ended."""

    number: int
    overrides: str
    ok: bool
    value: float | None
    message: str


MAX_POINT_NAME = 200
"""Longest run dir name of a sweep point, in bytes (file systems allow 255)."""
SWEPT_KEYS: set[str] = set()
"""The keys the command line sweeps (`a,b`, `interval(...)`, `choice(...)`, `range(...)`)."""

OUTCOMES: list[Outcome] = []
"""The points of this process's sweep so far, in order (Hydra runs them in this process)."""


def swept_keys(arguments: list[str]) -> set[str]:
    """The keys of the overrides in `arguments` that sweep (Hydra settings aside)."""
    from hydra._internal.utils import get_args_parser
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(
        get_args_parser().parse_args(arguments).overrides
    )
    return {
        o.key_or_group
        for o in parsed
        if o.is_sweep_override() and not o.key_or_group.startswith("hydra")
    }


def point_dir_name(override_dirname: str, task: list[str], number: int) -> str:
    """The run dir name of a sweep point: Hydra's override string when it fits in
    MAX_POINT_NAME bytes, else the swept overrides and a hash of the whole string (stable,
    so the same point resumes in the same dir)."""
    name = _safe(override_dirname or f"point{number}")
    if len(name.encode()) <= MAX_POINT_NAME:
        return name
    swept = [o for o in task if o.split("=", 1)[0].lstrip("+~") in SWEPT_KEYS]
    digest = hashlib.sha1(override_dirname.encode()).hexdigest()[:8]
    short = _safe(",".join(swept)) or f"point{number}"
    return f"{short.encode()[: MAX_POINT_NAME - 9].decode(errors='ignore')}-{digest}"


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.=,-]+", "_", name)


def final_loss(run_dir: Path) -> float | None:
    """The run's last validation loss, else its last training loss, from metrics.jsonl."""
    path = run_dir / METRICS_FILE
    if not path.is_file():
        return None
    rows, _ = json_objects(path, "the run's metrics.jsonl (one JSON object per line)")
    for key in ("val_loss", "loss"):
        values = [row[key] for row in rows if isinstance(row.get(key), (int, float))]
        if values:
            return float(values[-1])
    return None


def run_point(
    number: int, overrides: str, execute: Callable[[], float | None], maximize: bool = False
) -> float:
    """Run one point; record and report how it ended. Its final loss, or the worst value
    (+inf, -inf when maximizing) for a failed point, a diverged one (NaN) or one that
    measured nothing (a plan, a script, a submitted job)."""
    worst = -math.inf if maximize else math.inf
    try:
        value = execute()
    except Stopped:
        raise
    except Failed as failed:
        lines = [line for line in failed.message.splitlines() if line.strip()] or [""]
        # "Recipe 'x' is not valid:" heads a list: its first problem says more.
        why = lines[1] if len(lines) > 1 and lines[0].endswith(":") else lines[0]
        return _record(Outcome(number, overrides, False, None, why), worst)
    except SystemExit as stop:
        ok = stop.code in (0, None)
        return _record(Outcome(number, overrides, ok, None, f"exit code {stop.code}"), worst)
    except Exception as err:  # any failure of one point, a bug included, spares the rest
        LOG.error(f"sweep point #{number} ({overrides}): {type(err).__name__}: {err}")
        why = str(err).splitlines()[0] if str(err) else type(err).__name__
        return _record(Outcome(number, overrides, False, None, why), worst)
    return _record(Outcome(number, overrides, True, value, ""), worst)


def _record(outcome: Outcome, worst: float) -> float:
    OUTCOMES.append(outcome)
    if not outcome.ok:
        where = f"#{outcome.number} ({outcome.overrides})"
        LOG.warning(f"sweep point {where} failed; the sweep goes on")
    value = outcome.value
    return worst if value is None or math.isnan(value) else value


def summary(outcomes: list[Outcome], stream: TextIO | None = None) -> str:
    """A heading with the counts, then a table of one row per point (number, ok/FAILED,
    final loss, overrides, why it failed), rendered for `stream` (launcher/tables.py)."""
    from pretrain.launcher.tables import new_table, render

    failed = sum(not o.ok for o in outcomes)
    table = new_table(("#", "right"), "status", ("loss", "right"), "overrides", "why")
    for o in outcomes:
        value = "" if o.value is None else f"{o.value:.4f}"
        why = o.message.splitlines()[0] if o.message else ""
        table.add_row(f"#{o.number}", "ok" if o.ok else "FAILED", value, o.overrides, why)
    heading = f"sweep: {len(outcomes)} points, {len(outcomes) - failed} ok, {failed} failed"
    return render(table, stream, heading)
