"""One trainer per run dir: the lock names its holder, refuses a second one, and is taken
over when its holder is gone."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys

import pytest

from pretrain.core.run import run_lock
from pretrain.core.run.run_lock import LockHolder, RunDirInUse, acquire, check_free, held, release
from pretrain.core.run.rundir import LOCK_FILE


def dead_pid() -> int:
    """The PID of a process that has exited."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def holder(**changes: object) -> LockHolder:
    return dataclasses.replace(LockHolder.this_process(), **changes)


@pytest.fixture(autouse=True)
def _outside_slurm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv(run_lock.TOKEN_ENV, raising=False)


def test_the_lock_file_names_host_pid_start_time_and_slurm_job(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    me = LockHolder.this_process()
    assert acquire(tmp_path, me) == (True, None)
    written = json.loads((tmp_path / LOCK_FILE).read_text())
    assert written["host"] == socket.gethostname() and written["pid"] == os.getpid()
    assert written["slurm_job_id"] == "4242" and written["started"] == me.started
    assert written["pid_start"] > 0


def test_a_second_claimant_is_refused_naming_the_live_holder(tmp_path) -> None:
    first = holder()
    acquire(tmp_path, first)
    with pytest.raises(RunDirInUse) as refused:
        acquire(tmp_path, holder())
    message = str(refused.value)
    assert f"pid {os.getpid()} on host {socket.gethostname()} since {first.started}" in message
    assert "pick another run.dir" in message
    with pytest.raises(RunDirInUse):
        check_free(tmp_path)


def test_a_lock_whose_process_is_gone_is_taken_over_with_a_note(tmp_path) -> None:
    stale = holder(pid=dead_pid())
    acquire(tmp_path, stale)
    check_free(tmp_path)  # a stale lock does not block
    fresh = holder()
    acquired, note = acquire(tmp_path, fresh)
    assert acquired
    assert note == f"took over the lock of {stale.describe()}, which is no longer running"
    assert json.loads((tmp_path / LOCK_FILE).read_text())["token"] == fresh.token


def test_a_reused_pid_of_another_process_counts_as_gone(tmp_path) -> None:
    acquire(tmp_path, holder(pid_start=1))  # our pid, but a process that started at tick 1
    assert acquire(tmp_path, holder())[0]


def test_the_lock_of_an_earlier_attempt_of_the_same_slurm_job_is_taken_over(
    tmp_path, monkeypatch
) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    acquire(tmp_path, holder(host="another-node", slurm_job_id="77"))
    acquired, note = acquire(tmp_path, holder())
    assert acquired and "an earlier attempt of this SLURM job" in note


def test_a_holder_on_another_host_without_slurm_is_refused_with_how_to_remove_it(
    tmp_path,
) -> None:
    acquire(tmp_path, holder(host="elsewhere", slurm_job_id=""))
    with pytest.raises(RunDirInUse, match=f"if it does not, remove {tmp_path / LOCK_FILE}"):
        acquire(tmp_path, holder())


def test_a_finished_slurm_job_on_another_host_is_stale(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(run_lock, "slurm_job_ended", lambda job_id: job_id == "12")
    finished, running = tmp_path / "finished", tmp_path / "running"
    acquire(finished, holder(host="node7", slurm_job_id="12"))
    assert acquire(finished, holder())[0]
    acquire(running, holder(host="node8", slurm_job_id="13"))
    with pytest.raises(RunDirInUse, match=r"on host node8 since .* \(SLURM job 13\)"):
        acquire(running, holder())


def test_an_unreadable_lock_is_taken_over(tmp_path) -> None:
    (tmp_path / LOCK_FILE).write_text("garbage")
    acquired, note = acquire(tmp_path, holder())
    assert acquired and note == "took over the lock of an unreadable lock"


def test_rank_0_inherits_the_launchers_lock_and_leaves_it_in_place(tmp_path, monkeypatch) -> None:
    launcher = holder()
    acquire(tmp_path, launcher)
    monkeypatch.setenv(run_lock.TOKEN_ENV, launcher.token)
    with held(tmp_path) as note:
        assert note is None
    assert json.loads((tmp_path / LOCK_FILE).read_text())["token"] == launcher.token


def test_held_releases_its_own_lock_and_release_spares_a_takeovers(tmp_path) -> None:
    with held(tmp_path):
        assert (tmp_path / LOCK_FILE).exists()
    assert not (tmp_path / LOCK_FILE).exists()
    other = holder()
    acquire(tmp_path, other)
    release(tmp_path, "not-the-token")
    assert (tmp_path / LOCK_FILE).exists()


def test_only_rank_0_takes_the_lock(tmp_path) -> None:
    with held(tmp_path, enabled=False):
        assert not (tmp_path / LOCK_FILE).exists()
