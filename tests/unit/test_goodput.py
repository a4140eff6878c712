"""The goodput account: events of a run's jobs and attempts partition its wall time into
productive steps, saves, loads, start-up, evaluation, recomputed steps, failures, queue
waits, time between jobs and shut-down (core/run/goodput.py)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from pretrain.core.run.goodput import append_event, breakdown, scontrol_times
from pretrain.core.run.metric_names import flat_name, wandb_key
from pretrain.trainer.observe.goodput import (
    GoodputLedger,
    attempt_start,
    later_attempt_in_job,
    slurm_queue_wait,
)

# A job that trains steps 1-6 from t=100 (ready at 110 after 2 s of load), saves 4, is
# killed after logging step 6; torchrun restarts it at 140 from step 4; it stops cleanly
# after step 8, the launcher sees the exit at 161; a second job starts at 170 (queued 3 s)
# and finishes step 10 at 185, exiting at 186.
EVENTS = [
    {"event": "attempt", "t0": 100.0, "t": 110.0, "resumed_from": 0, "load_s": 2.0},
    {"event": "save", "step": 4, "s": 1.5, "t": 116.0},
    {"event": "steps", "first": 1, "last": 4, "s": 4.0, "eval_s": 0.5, "t": 116.0},
    {"event": "steps", "first": 5, "last": 6, "s": 2.0, "eval_s": 0.0, "t": 118.0},
    {"event": "attempt", "t0": 140.0, "t": 150.0, "resumed_from": 4, "load_s": 1.0},
    {"event": "steps", "first": 5, "last": 8, "s": 8.0, "eval_s": 1.0, "t": 159.0},
    {"event": "save", "step": 8, "s": 0.5, "t": 159.5},
    {"event": "end", "how": "stopped", "t": 160.0},
    {"event": "job_end", "code": 0, "t": 161.0},
    {
        "event": "attempt",
        "t0": 170.0,
        "t": 175.0,
        "resumed_from": 8,
        "load_s": 1.0,
        "queue_s": 3.0,
    },
    {"event": "steps", "first": 9, "last": 10, "s": 9.0, "eval_s": 0.0, "t": 184.0},
    {"event": "end", "how": "finished", "t": 185.0},
    {"event": "job_end", "code": 0, "t": 186.0},
]


def test_the_terms_of_a_killed_restarted_stopped_and_resumed_run() -> None:
    account = breakdown(EVENTS)
    assert account.attempts == 3
    assert account.total_s == 86.0  # 100 to 186
    # Steps 5-6 of the first attempt were trained again after the restart from step 4.
    assert account.recomputed_s == 2.0
    assert account.productive_s == 4.0 + 8.0 + 9.0
    assert account.checkpoint_save_s == 2.0 and account.checkpoint_load_s == 4.0
    assert account.startup_s == (10 - 2) + (10 - 1) + (5 - 1)
    assert account.evaluation_s == 1.5
    assert account.failures_s == 140 - 118  # the killed attempt's last event to the restart
    assert account.queue_s == 3.0 and account.between_jobs_s == 170 - 161 - 3
    assert account.shutdown_s == 1.0 + 1.0
    assert account.goodput == 21.0 / 86.0
    assert account.unaccounted_s == pytest.approx(86.0 - sum(account.terms.values()))


def test_a_resume_takes_back_only_the_steps_past_its_checkpoint_pro_rata() -> None:
    events = [
        {"event": "attempt", "t0": 0.0, "t": 1.0, "resumed_from": 0},
        {"event": "steps", "first": 1, "last": 4, "s": 8.0, "t": 9.0},
        {"event": "attempt", "t0": 10.0, "t": 11.0, "resumed_from": 3},
    ]
    account = breakdown(events)
    assert account.recomputed_s == 2.0 and account.productive_s == 6.0


def test_the_first_jobs_queue_wait_starts_the_run_and_a_missing_one_is_said() -> None:
    events = [
        {"event": "attempt", "t0": 50.0, "t": 60.0, "resumed_from": 0, "queue_s": 20.0},
        {"event": "steps", "first": 1, "last": 1, "s": 10.0, "t": 70.0},
        {"event": "end", "how": "stopped", "t": 70.0},
        {
            "event": "attempt",
            "t0": 80.0,
            "t": 81.0,
            "resumed_from": 1,
            "queue_note": "scontrol show job 7 failed (FileNotFoundError)",
        },
    ]
    account = breakdown(events)
    assert account.total_s == 81.0 - 30.0 and account.queue_s == 20.0
    assert account.between_jobs_s == 10.0
    assert "queue wait left out: scontrol show job 7 failed" in account.line()


def test_a_job_that_fails_counts_its_last_seconds_as_failure_and_a_cut_line_is_skipped(
    tmp_path: Path,
) -> None:
    append_event(tmp_path, {"event": "attempt", "t0": 1.0, "t": 2.0, "resumed_from": 0})
    append_event(tmp_path, {"event": "steps", "first": 1, "last": 2, "s": 3.0, "t": 5.0})
    append_event(tmp_path, {"event": "job_end", "code": 1, "t": 9.0})
    with (tmp_path / "goodput.jsonl").open("a") as f:
        f.write('{"event": "steps", "fir')
    ledger = GoodputLedger(tmp_path, is_main=True)
    account = ledger.breakdown()
    assert account.failures_s == 4.0 and account.productive_s == 3.0 and account.total_s == 8.0


def test_the_ledger_writes_an_attempt_its_steps_and_saves_and_logs_the_goodput(
    tmp_path: Path,
) -> None:
    ledger = GoodputLedger(tmp_path, is_main=True)
    ledger.begin(resumed_from=0, load_s=0.0)
    time.sleep(0.02)
    ledger.step(1, save_s=0.0, eval_s=0.0)
    time.sleep(0.02)
    ledger.step(2, save_s=0.01, eval_s=0.0)
    metrics = ledger.flush()
    ledger.end("finished")
    kinds = [json.loads(line)["event"] for line in (tmp_path / "goodput.jsonl").open()]
    assert kinds == ["attempt", "save", "steps", "end"]
    assert metrics["goodput"] is not None and 0 <= metrics["goodput"] <= 1
    assert set(metrics) == {"goodput", "goodput_total_s", *(f"goodput_{t}" for t in
                            ledger.breakdown().terms)}  # fmt: skip
    assert not GoodputLedger(tmp_path / "other", is_main=False).flush()


def test_goodput_metrics_go_under_their_own_wandb_section() -> None:
    assert wandb_key("goodput") == "goodput/goodput"
    assert wandb_key("goodput_recomputed_s") == "goodput/recomputed_s"
    assert flat_name("goodput/recomputed_s") == "goodput_recomputed_s"
    assert flat_name("goodput/goodput") == "goodput"


def test_a_restarted_attempt_starts_at_its_own_rank_start() -> None:
    env = {"TORCHELASTIC_RESTART_COUNT": "1", "PRETRAIN_RANK_T0": "123.5"}
    assert attempt_start(env) == 123.5
    assert slurm_queue_wait({**env, "SLURM_JOB_ID": "5"}) == {}  # counted once per job
    assert slurm_queue_wait({}) == {}


def test_a_later_step_of_a_slurm_job_counts_neither_the_job_start_nor_its_queue_wait() -> None:
    """A job that lost a node goes on in a second srun step: that attempt starts when its
    ranks do, and the job's queue wait was counted by the first."""
    later = {"SLURM_JOB_ID": "5", "SLURM_STEP_ID": "1"}
    assert slurm_queue_wait(later) == {}
    assert later_attempt_in_job(later)
    assert not later_attempt_in_job({"SLURM_JOB_ID": "5", "SLURM_STEP_ID": "0"})


def test_the_queue_wait_is_read_from_scontrol_submit_and_start_times() -> None:
    shown = "JobId=7 JobName=x SubmitTime=2026-01-02T10:00:00 EligibleTime=2026-01-02T10:00:00 "
    submit, started = scontrol_times(shown + "StartTime=2026-01-02T10:02:05 EndTime=Unknown")
    assert started - submit == 125.0
    assert scontrol_times(shown + "StartTime=Unknown") is None


def test_a_slurm_jobs_attempt_starts_at_the_job_start_with_its_queue_wait(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stand-in scontrol on PATH prints what SLURM's would."""
    scontrol = tmp_path / "bin" / "scontrol"
    scontrol.parent.mkdir()
    scontrol.write_text("#!/bin/sh\necho JobId=$4 SubmitTime=2026-01-02T10:00:00 "
                        "StartTime=2026-01-02T10:00:30 EndTime=Unknown\n")  # fmt: skip
    scontrol.chmod(0o755)
    monkeypatch.setenv("PATH", f"{scontrol.parent}:{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    ledger = GoodputLedger(tmp_path / "run", is_main=True)
    (tmp_path / "run").mkdir()
    ledger.begin(resumed_from=0, load_s=0.0)
    [attempt] = [json.loads(line) for line in (tmp_path / "run" / "goodput.jsonl").open()]
    assert attempt["queue_s"] == 30.0
    assert attempt["t0"] == time.mktime(time.strptime("2026-01-02T10:00:30", "%Y-%m-%dT%H:%M:%S"))
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    assert slurm_queue_wait() == {"queue_note": "scontrol show job 7 failed (FileNotFoundError)"}


def test_values_that_are_not_finite_numbers_count_as_nothing() -> None:
    events = [
        {"event": "attempt", "t0": 0.0, "t": 1.0, "resumed_from": "x"},
        {"event": "steps", "first": 1, "last": 1, "s": float("nan"), "t": 2.0},
        {"event": "save", "step": 1, "s": 10**400, "t": 3.0},
        {"event": "steps", "first": 2, "last": 2, "s": True, "t": 4.0},
    ]
    account = breakdown(events)
    assert account.productive_s == 0.0 and account.checkpoint_save_s == 0.0
    assert account.total_s == 4.0


def test_a_rollback_counts_the_steps_since_its_checkpoint_as_recomputed_and_its_load() -> None:
    events = [
        {"event": "attempt", "t0": 0.0, "t": 1.0, "resumed_from": 0},
        {"event": "steps", "first": 1, "last": 6, "s": 6.0, "t": 7.0},
        {"event": "rollback", "to": 4, "load_s": 0.5, "t": 7.5},
        {"event": "steps", "first": 5, "last": 8, "s": 4.0, "t": 11.5},
    ]
    account = breakdown(events)
    assert account.recomputed_s == 2.0 and account.productive_s == 8.0
    assert account.checkpoint_load_s == 0.5


def test_time_no_event_measured_is_shown_as_unmeasured() -> None:
    events = [
        {"event": "attempt", "t0": 0.0, "t": 1.0, "resumed_from": 0},
        {"event": "steps", "first": 1, "last": 2, "s": 5.0, "t": 9.0},
    ]
    account = breakdown(events)
    assert account.unaccounted_s == 3.0
    assert account.line() == (
        "goodput 55.6% of 9.0s over 1 attempt: productive 5.0s, startup 1.0s, unmeasured 3.0s"
    )
