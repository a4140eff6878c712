"""`pretrain status`: a run dir's or a sweep's state, read from the files the run wrote."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from pretrain.core.run.checkpoint_files import DCP_METADATA, META, step_dir
from pretrain.core.run.goodput import append_event
from pretrain.core.schema import RecipeConfig, dump_config
from pretrain.launcher.job.status import render_status


def make_run(run_dir: Path, steps_done: int, total: int = 10, job: str = "") -> Path:
    """A run dir as a trainer leaves it: config, metrics, a checkpoint, maybe a job id."""
    cfg = RecipeConfig()
    cfg.train.steps = total
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(dump_config(cfg))
    rows = [{"step": s, "loss": 5.0 - s / 10, "tokens_per_s": 1234.5, "step_time_s": 30.0}
            for s in range(1, steps_done + 1)]  # fmt: skip
    rows[-1]["val_loss"] = 4.75
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    checkpoint = step_dir(run_dir / "checkpoints", steps_done)
    checkpoint.mkdir(parents=True)
    (checkpoint / META).write_text("{}")
    (checkpoint / DCP_METADATA).write_text("")
    if job:
        (run_dir / "slurm_job_id").write_text(job + "\n")
    return run_dir


def columns(line: str) -> list[str]:
    """The cells of a table row: columns are at least two blanks apart."""
    return re.split(r"\s{2,}", line.strip())


def status(*paths: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "SLURM_CONF"}  # no controller
    return subprocess.run([sys.executable, "-m", "pretrain", "status", *map(str, paths)],
                          capture_output=True, text=True, env=env, timeout=60)  # fmt: skip


def test_status_of_a_run_dir_names_its_step_losses_eta_checkpoint_and_job(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path / "run", steps_done=4, job="4242")
    (run_dir / "preempted").touch()
    result = status(run_dir)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == str(run_dir)
    fields = dict(columns(line) for line in lines[1:])
    assert fields["step"] == "4/10" and fields["loss"] == "4.6000"
    assert fields["val loss"] == "4.7500"
    assert fields["ETA"] == "3m00s"  # 6 steps of 30 s
    assert fields["checkpoint"] == "step 4" and fields["preempted"] == "yes"
    assert fields["slurm"].startswith("4242 (unknown: ")  # no controller to ask here


def test_status_of_a_sweep_dir_has_one_row_per_point(tmp_path: Path) -> None:
    make_run(tmp_path / "sweep" / "seed=1", steps_done=10)
    make_run(tmp_path / "sweep" / "seed=2", steps_done=3)
    lines = status(tmp_path / "sweep").stdout.splitlines()
    assert lines[0] == f"{tmp_path / 'sweep'}: 2 points"
    assert columns(lines[1]) == ["point", "step", "loss", "val loss", "ETA", "checkpoint", "slurm"]
    assert set(lines[2]) == {"-"}  # the rule under the header
    assert columns(lines[3])[:5] == ["seed=1", "10/10", "4.0000", "4.7500", "done"]
    assert columns(lines[4])[:5] == ["seed=2", "3/10", "4.7000", "4.7500", "3m30s"]
    assert "\x1b[" not in lines[0] + lines[3]  # a pipe gets no colour codes


def test_status_of_a_path_that_is_no_run_dir_says_so_and_fails(tmp_path: Path) -> None:
    result = status(tmp_path)
    assert result.returncode == 2
    assert "holds no config.yaml, nor run dirs that do" in result.stderr


def test_status_shows_the_goodput_and_where_the_time_went(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path / "run", steps_done=10)
    events = [
        {"event": "attempt", "t0": 100.0, "t": 110.0, "resumed_from": 0, "load_s": 2.0},
        {"event": "steps", "first": 1, "last": 6, "s": 6.0, "t": 117.0},
        {"event": "attempt", "t0": 140.0, "t": 150.0, "resumed_from": 4, "load_s": 1.0},
        {"event": "steps", "first": 5, "last": 10, "s": 30.0, "t": 181.0},
        {"event": "end", "how": "finished", "t": 182.0},
    ]
    for event in events:
        append_event(run_dir, event)
    shown = render_status(run_dir).splitlines()
    _, value = next(x.split(maxsplit=1) for x in shown if x.strip().startswith("goodput"))
    # 6 s of steps, 2 of them (steps 5-6) trained again, and 30 s: 34 s of 82.
    assert value.startswith("41.5% of 1m22s over 2 attempts: productive 34.0s, ")
    assert "recomputed 2.0s" in value and "failures 23.0s" in value and "queue" not in value


def test_status_counts_the_fault_actions_and_names_the_last(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path / "run", steps_done=8)

    def faults() -> str:
        line = next(
            x for x in render_status(run_dir).splitlines() if x.strip().startswith("faults")
        )
        return line.split(maxsplit=1)[1]

    assert faults() == "-"
    rows = [
        {"step": 3, "trigger": "nan", "action": "skip"},
        {"step": 6, "trigger": "spike", "action": "rollback", "to": 4},
    ]
    (run_dir / "faults.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert faults() == "2 actions, the last step 6: spike rollback to step 4"
