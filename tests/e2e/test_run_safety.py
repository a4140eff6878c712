"""A run dir is safe to train in: one trainer at a time, no trainer outlives its launcher,
a corrupt checkpoint is survived, a full disk is named, no secret is ever stored, and a
rank's failure ends in a short summary with the traceback in the run dir's logs (each
cause is classified in tests/unit/test_failure_report.py; the NaN halt and the collective
timeout end to end in tests/distributed/test_checkpoint_resume.py).

Every test launches real torchrun processes of the harness model through the CLI.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pretrain.core.run.rundir import LOCK_FILE, PREEMPTED_MARKER
from pretrain.core.schema import load_config
from tests.distributed.harness import BASE_OVERRIDES
from tests.helpers import live_processes, pretrain, wait_until_gone

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SECRETS = {
    "HF_TOKEN": "hf_plantedSecretValue0001",
    "WANDB_API_KEY": "0123456789abcdef0123456789abcdef01234567",
    "MY_SERVICE_TOKEN": "planted-service-token-0002",
}


def args(run_dir: Path, *overrides: str, ranks: int = 1) -> list[str]:
    return [*BASE_OVERRIDES, f"cluster.gpus_per_node={ranks}", f"run.dir={run_dir}", *overrides]


def start(run_dir: Path, *overrides: str, ranks: int = 1) -> subprocess.Popen:
    """A launcher in the background, returned once its ranks have logged a step."""
    launcher = subprocess.Popen(
        [sys.executable, "-m", "pretrain", *args(run_dir, *overrides, ranks=ranks)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )  # fmt: skip
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while not (metrics.exists() and metrics.read_text()):
        assert launcher.poll() is None, launcher.stderr.read().decode()[-3000:]
        assert time.monotonic() < deadline, "no step was logged"
        time.sleep(0.2)
    return launcher


def test_one_trainer_per_run_dir_and_none_outlives_a_killed_launcher(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    config = str(run_dir / "config.yaml")
    launcher = start(run_dir, "train.steps=100000", ranks=2)
    try:
        assert len(live_processes(config)) == 3  # torchrun and two ranks
        second = pretrain(*args(run_dir, "train.steps=100000", ranks=2), cwd=tmp_path)
        assert second.returncode == 2
        assert f"run dir {run_dir} is in use by pid {launcher.pid} on host" in second.stderr
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait(timeout=10)
        orphans = wait_until_gone(config)
    finally:
        for pid in live_processes(config):
            os.kill(pid, signal.SIGKILL)
    assert orphans == []
    # The dead launcher's lock is stale: the next run takes it over and says so.
    third = pretrain(*args(run_dir, "train.steps=2"), cwd=tmp_path, timeout=300)
    assert third.returncode == 0, third.stderr[-3000:]
    assert f"took over the lock of pid {launcher.pid} on host" in third.stderr
    assert "which is no longer running" in third.stderr
    assert not (run_dir / LOCK_FILE).exists()


def test_sigterm_to_the_launcher_stops_every_rank(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    launcher = start(run_dir, "train.steps=100000")
    launcher.send_signal(signal.SIGTERM)
    code = launcher.wait(timeout=120)
    stderr = launcher.stderr.read().decode()
    # Ranks that got as far as saving leave the preempted marker and the launcher exits 0;
    # a stop before that exits 128 + SIGTERM.
    assert code == (0 if (run_dir / PREEMPTED_MARKER).exists() else 128 + signal.SIGTERM)
    assert "stopped by SIGTERM; run the same command again to resume" in stderr
    assert "Traceback" not in stderr
    assert wait_until_gone(str(run_dir / "config.yaml")) == []
    assert not (run_dir / LOCK_FILE).exists()


def assert_failure_summary(result: subprocess.CompletedProcess, run_dir: Path, *words: str):
    """The launcher's summary names the rank, host, cause and fix; no traceback is shown,
    the full one is in the rank's log."""
    assert result.returncode != 0
    assert "Traceback" not in result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    summary = next(i for i, line in enumerate(lines) if line.startswith("training failed on"))
    assert all(word in lines[summary] for word in words), lines[summary]
    assert lines[summary + 1].startswith("  fix: ")
    log = Path(lines[summary + 2].removeprefix("  traceback: "))
    assert log.parent == run_dir / "logs"
    assert "Traceback (most recent call last)" in log.read_text()


def test_out_of_memory_ends_in_a_summary_beside_the_plans_prediction(
    tmp_path: Path, monkeypatch
) -> None:
    run_dir = tmp_path / "run"
    monkeypatch.setenv("PRETRAIN_FAULT_OOM", "0:2")
    result = pretrain(*args(run_dir), cwd=tmp_path, timeout=300)
    predicted = json.loads((run_dir / "plan.json").read_text())["memory_gib"]
    assert_failure_summary(
        result, run_dir, "rank 0 of 1", "out of memory (peak ",
        f"the plan predicted {predicted:.2f} GiB per rank",
    )  # fmt: skip


def test_corrupt_checkpoints_are_moved_aside_and_the_previous_one_resumes(tmp_path) -> None:
    run_dir = tmp_path / "run"
    every = ["checkpoint.every=2", "checkpoint.keep=3"]
    first = pretrain(*args(run_dir, "train.steps=6", *every), cwd=tmp_path, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    checkpoints = run_dir / "checkpoints"
    shard = next((checkpoints / "step_00000006").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    (checkpoints / "step_00000004" / "meta.json").write_text("{garbled")
    (checkpoints / "step_00000008.tmp").mkdir()  # a save that never finished
    resumed = pretrain(*args(run_dir, "train.steps=8", *every), cwd=tmp_path, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    output = resumed.stdout + resumed.stderr
    assert f"checkpoint step_00000006 is unusable ({shard.name} is" in output
    assert "checkpoint step_00000004 is unusable (meta.json is 8 bytes" in output
    assert "meta.json: not valid JSON" in output
    assert "resumed from the checkpoint of step 2" in output
    names = sorted(p.name for p in checkpoints.iterdir())
    assert "step_00000006.corrupt" in names and "step_00000004.corrupt" in names
    assert "step_00000008.tmp" not in names and "step_00000008" in names
    assert (checkpoints / "step_00000008" / "manifest.json").is_file()
    # The run's story ends with its summary; run again, the finished run says so and what
    # to do, and starts no rank.
    assert "run finished: 8 steps" in resumed.stdout
    assert f"checkpoint: {checkpoints / 'step_00000008'}" in resumed.stdout
    rows = (run_dir / "metrics.jsonl").read_text()
    again = pretrain(*args(run_dir, "train.steps=8", *every), cwd=tmp_path, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "already finished: its newest checkpoint is step 8 of train.steps=8" in again.stderr
    assert "raise train.steps" in again.stderr
    assert (run_dir / "metrics.jsonl").read_text() == rows


@pytest.fixture
def small_disk(tmp_path: Path):
    """A 16 MiB file system: room, by the launcher's sizing, for the three checkpoints of the
    harness model on disk at once (two kept and one being written)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mount = tmp_path / "disk"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mount)]).returncode:
        pytest.skip("mount is not permitted here")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


def fill(disk: Path, leave: int) -> None:
    """Fill `disk` but for `leave` bytes."""
    room = shutil.disk_usage(disk).free - leave
    with (disk / "filler").open("wb") as filler:
        while room > 0:
            room -= filler.write(b"\0" * min(room, 1 << 20))


def test_a_disk_filled_during_the_run_is_named_before_the_save_and_then_refused_at_launch(
    small_disk: Path, tmp_path: Path
) -> None:
    run_dir = small_disk / "run"
    # The first save comes at step 4, each step 0.5 s slower: time to fill the disk after
    # step 1 is logged, which the launcher's room check (before the run) cannot foresee;
    # the ranks' own check before the save names it.
    overrides = ["checkpoint.every=4", "train.steps=6"]
    launcher = subprocess.Popen(
        [sys.executable, "-m", "pretrain", *args(run_dir, *overrides)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
        env=dict(os.environ, OMP_NUM_THREADS="1", PRETRAIN_FAULT_SLOW_RANK="0:0.5"),
    )  # fmt: skip
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while not (metrics.exists() and metrics.read_text()):
        assert launcher.poll() is None and time.monotonic() < deadline, "no step was logged"
        time.sleep(0.1)
    # Room left for the logs and the failure record, not for a checkpoint (about 3.5 MB).
    fill(small_disk, leave=1 << 20)
    stdout, stderr = launcher.communicate(timeout=300)
    result = subprocess.CompletedProcess(launcher.args, launcher.returncode, stdout, stderr)
    assert_failure_summary(result, run_dir, "disk full", "the checkpoint of step 4 needs")
    assert f"GiB on {run_dir / 'checkpoints'}" in result.stderr
    assert not (run_dir / "checkpoints").exists() or not [
        p for p in (run_dir / "checkpoints").iterdir() if not p.name.endswith(".tmp")
    ]
    # Run again on the full disk: refused before any rank starts, naming the field and room.
    rerun = pretrain(*args(run_dir, *overrides), cwd=tmp_path, timeout=300)
    assert rerun.returncode == 2
    assert "Traceback" not in rerun.stdout + rerun.stderr
    assert "checkpoint.keep=2" in rerun.stderr and "0.00 GiB free" in rerun.stderr


def test_no_secret_reaches_any_file_of_a_finished_run_and_modes_honour_the_umask(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    literal = "\\${oc.env:HF_TOKEN}"
    env = {**os.environ, **SECRETS, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    result = subprocess.run(
        [sys.executable, "-m", "pretrain", *args(run_dir, "logging.wandb=offline",
         f"+cluster.env.PRETRAIN_LITERAL='{literal}'")],
        capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path,
        preexec_fn=lambda: os.umask(0o077),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    files = [p for p in run_dir.rglob("*") if p.is_file()]
    assert any("wandb" in p.parts for p in files) and (run_dir / "checkpoints").is_dir()
    found = [
        (p, name) for p in files for name, v in SECRETS.items() if v.encode() in p.read_bytes()
    ]
    assert found == []
    loose = [p for p in run_dir.rglob("*") if p.stat().st_mode & 0o077]
    assert loose == []
    # config.yaml is faithful: the escaped interpolation is a literal for the ranks too.
    assert load_config(str(run_dir / "config.yaml")).cluster.env["PRETRAIN_LITERAL"] == (
        "${oc.env:HF_TOKEN}"
    )
