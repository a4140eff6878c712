"""A stop signal to the launcher reaches the local job, and a job that ignores it is killed
once its grace time is over (what torchrun's shutdown timeout does for the ranks it runs)."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import pytest

from pretrain.launcher.job import backends


def started_job(script: str) -> subprocess.Popen:
    """A bash job in a session of its own, once it says it is ready; a SIGTERM to this
    process follows 0.2 s later (the launcher forwards it to the job)."""
    job = subprocess.Popen(
        ["bash", "-c", f"{script}; echo ready; sleep 60 & wait; sleep 60"],
        start_new_session=True, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert job.stdout is not None and job.stdout.readline() == "ready\n"
    threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM)).start()
    return job


def test_a_job_that_ignores_the_forwarded_sigterm_is_killed_after_its_grace(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(backends, "KILL_MARGIN_S", 0.0)
    job = started_job('trap "" TERM')
    stopped: list[str] = []
    start = time.monotonic()
    code = backends.wait_forwarding_signals(job, threading.Event(), stopped, grace_s=1.0)
    assert stopped == ["SIGTERM"]
    assert code == -signal.SIGKILL
    assert 1.0 <= time.monotonic() - start < 10


def test_a_job_that_ends_within_its_grace_keeps_its_own_exit_code() -> None:
    job = started_job("trap 'exit 0' TERM")
    stopped: list[str] = []
    assert backends.wait_forwarding_signals(job, threading.Event(), stopped, grace_s=30) == 0
    assert stopped == ["SIGTERM"]
