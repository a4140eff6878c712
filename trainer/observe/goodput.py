"""The trainer's side of the goodput account (core/run/goodput.py): the main rank writes an
event when an attempt starts training, at every logged step (the steps since the last one),
at every checkpoint save and at the end, and keeps the run's account in memory so that each
logged step carries the goodput so far (folded in as written: a logged step costs the same
late in a long run). Other ranks hold an inert ledger.
"""

from __future__ import annotations

import math
import os
import subprocess
import time
from pathlib import Path
from typing import Any

from pretrain.core.inputs.reading import ReadError, json_objects
from pretrain.core.run.goodput import Account, Breakdown, append_event, scontrol_times
from pretrain.core.run.rundir import GOODPUT_FILE
from pretrain.trainer.observe.startup import CLOCK, RANK_ENV

SCONTROL_TIMEOUT_S = 10.0
"""How long the queue wait may take to read from SLURM before it is left out."""


def later_attempt_in_job(environ: dict[str, str] | os._Environ[str] = os.environ) -> bool:
    """Whether this attempt follows an earlier one of the same job: a restart by torchrun,
    or a later step of a SLURM job (one that went on with the nodes it kept after losing
    some); its job's start and queue wait belong to the first attempt."""
    restarted = environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"
    return restarted or environ.get("SLURM_STEP_ID", "0") not in ("0", "")


def attempt_start(environ: dict[str, str] | os._Environ[str] = os.environ) -> float:
    """When this attempt started: the rank's own start after a restart by torchrun (the
    launcher's stamps are the first attempt's), else the first stamp of its start-up."""
    if environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0" and RANK_ENV in environ:
        return float(environ[RANK_ENV])
    return CLOCK.marks[0][1] if CLOCK.marks else time.time()


def slurm_queue_wait(environ: dict[str, str] | os._Environ[str] = os.environ) -> dict[str, Any]:
    """`queue_s` of this SLURM job (submission, or requeue, to start) and `job_start` as
    scontrol reports them, or `queue_note` saying why they are left out; {} outside SLURM
    and for a later attempt within the job (its queue wait is counted once)."""
    job = environ.get("SLURM_JOB_ID")
    if not job or later_attempt_in_job(environ):
        return {}
    try:
        shown = subprocess.run(
            ["scontrol", "--oneliner", "show", "job", job],
            capture_output=True, text=True, timeout=SCONTROL_TIMEOUT_S, check=False,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as err:
        return {"queue_note": f"scontrol show job {job} failed ({type(err).__name__})"}
    times = scontrol_times(shown.stdout)
    if times is None:
        return {"queue_note": f"scontrol show job {job} gave no SubmitTime and StartTime"}
    submit, started = times
    return {"queue_s": round(max(0.0, started - submit), 3), "job_start": started}


class GoodputLedger:
    """The main rank's record of where this attempt's time goes."""

    def __init__(self, run_dir: Path, is_main: bool) -> None:
        self.run_dir = Path(run_dir)
        self.is_main = is_main
        self.account = Account()
        self._first = 0
        self._last = 0
        self._step_s = 0.0
        self._eval_s = 0.0
        self._mark = time.time()
        if is_main:
            for event in _history(self.run_dir / GOODPUT_FILE):
                self.account.add(event)

    def _write(self, event: dict[str, Any]) -> None:
        if not self.is_main:
            return
        event = {**event, "t": round(time.time(), 3)}
        append_event(self.run_dir, event)
        self.account.add(event)

    def begin(self, resumed_from: int, load_s: float) -> None:
        """The attempt's first step starts now; it resumed from `resumed_from` after a
        checkpoint load of `load_s` seconds."""
        self._mark = time.time()
        if not self.is_main:
            return
        slurm = slurm_queue_wait()
        # A SLURM job starts before its ranks do (the batch script, srun, torchrun).
        t0 = round(min(attempt_start(), slurm.pop("job_start", math.inf)), 3)
        self._write({"event": "attempt", "t0": t0, "resumed_from": resumed_from,
                     "load_s": round(load_s, 3), **slurm})  # fmt: skip

    def step(self, step: int, save_s: float, eval_s: float) -> None:
        """Step `step` ends now: the loop's time since the previous one ended, less
        `save_s` in a checkpoint save and `eval_s` in evaluation, was training (the
        metrics logged after a step count in the next one)."""
        now = time.time()
        if not self._first:
            self._first = step
        self._last = step
        self._step_s += now - self._mark - save_s - eval_s
        self._eval_s += eval_s
        self._mark = now
        if save_s > 0:
            self.saved(step, save_s)

    def saved(self, step: int, seconds: float) -> None:
        """The checkpoint of `step` kept the loop waiting `seconds`."""
        self._write({"event": "save", "step": step, "s": round(seconds, 4)})

    def rolled_back(self, to: int, load_s: float) -> None:
        """A rollback reloaded the checkpoint of `to` in `load_s` seconds: the steps since
        it are trained again."""
        self._write({"event": "rollback", "to": to, "load_s": round(load_s, 3)})
        self._mark = time.time()

    def flush(self) -> dict[str, float | None]:
        """Write the steps since the last flush; the goodput metrics of the run so far."""
        if self._first:
            seconds = {"s": round(self._step_s, 4), "eval_s": round(self._eval_s, 4)}
            self._write({"event": "steps", "first": self._first, "last": self._last, **seconds})
        self._first = self._last = 0
        self._step_s = self._eval_s = 0.0
        return self.breakdown().metrics() if self.is_main else {}

    def end(self, how: str) -> None:
        """The trainer is done (`finished` or `stopped`); writes the last steps first."""
        self.flush()
        self._write({"event": "end", "how": how})

    def breakdown(self) -> Breakdown:
        """The terms of the run's events so far."""
        return self.account.breakdown()


def _history(path: Path) -> list[dict[str, Any]]:
    """The events earlier attempts wrote ([] when none, or unreadable: the account starts
    over rather than stopping a run)."""
    if not path.exists():
        return []
    try:
        events, _ = json_objects(path, "the run's goodput.jsonl (one JSON object per line)")
    except ReadError:
        return []
    return events
