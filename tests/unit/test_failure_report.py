"""Every anticipated failure of a rank becomes one line of cause and one of fix, recorded in
the run dir with its traceback; the launcher sums up the first failure."""

from __future__ import annotations

import errno
import json
import socket
from pathlib import Path

import pytest
import torch

from pretrain.core.run.run_lock import LockHolder, RunDirInUse
from pretrain.core.run.rundir import PLAN_FILE
from pretrain.launcher.job.failure_summary import failure_message, has_failures, read_failures
from pretrain.trainer.checkpoint.integrity import DiskSpaceError, NoUsableCheckpoint
from pretrain.trainer.faults.failure_report import classify, record
from pretrain.trainer.faults.step_guard import TooManyBadSteps


def raised(exc: BaseException, *, chained_from: BaseException | None = None) -> BaseException:
    """`exc` as it arrives in an except clause: with a traceback (and a cause)."""
    try:
        raise exc from chained_from
    except BaseException as caught:
        return caught


def raised_in_data(exc: BaseException) -> BaseException:
    """`exc` raised from inside trainer/data/loader.py's code, as a data loader would."""
    code = compile("def load():\n    raise exc\n", "/repo/trainer/data/loader.py", "exec")
    scope: dict = {"exc": exc}
    exec(code, scope)
    try:
        scope["load"]()
    except BaseException as caught:
        return caught
    raise AssertionError("unreachable")


CAUSES = [
    ("data unreachable", raised_in_data(ConnectionError("Couldn't reach 'hf/x' on the Hub")),
     "data", "the data source is unreachable", "check the network"),
    ("data unreadable", raised_in_data(UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid")),
     "data", "not UTF-8 text", "remove binary files"),
    ("disk full check", raised(DiskSpaceError("the checkpoint of step 4 needs 1 GiB, has 0.1 GiB "
                                              "on /x")),
     "disk", "disk full: DiskSpaceError: the checkpoint of step 4 needs 1 GiB", "free space"),
    ("disk full write", raised(OSError(errno.ENOSPC, "No space left on device")),
     "disk", "disk full", "free space"),
    ("disk full torch", raised(RuntimeError("[enforce fail at inline_container.cc:672] . "
                                            "unexpected pos 704 vs 598")),
     "disk", "disk full", "lower checkpoint.keep"),
    ("corrupt checkpoints", raised(NoUsableCheckpoint(Path("/r/checkpoints"), ["step_4: bad"])),
     "checkpoint", "no checkpoint in /r/checkpoints can be loaded: step_4: bad", "moved aside"),
    ("out of memory", raised(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB")),
     "oom", "the plan predicted 3.50 GiB per rank", "lower train.micro_batch"),
    ("collective timeout", raised(RuntimeError("[gloo] Timed out waiting 5000ms for recv")),
     "timeout", "a collective timed out", "faults.collective_timeout_s"),
    ("peer lost", raised(RuntimeError("Read error: Connection reset by peer")),
     "peer", "lost the connection to another rank", "another rank failed first"),
    ("nan halt", raised(TooManyBadSteps("step 4: 2 consecutive steps with a non-finite loss")),
     "nan", "step 4: 2 consecutive steps with a non-finite loss", "lower optim.lr"),
    ("run dir in use", raised(RunDirInUse(Path("/r"), LockHolder("h", 1, "t", "x"))),
     "lock", "run dir /r is in use by pid 1 on host h", "another run.dir"),
    ("a bug", raised(ZeroDivisionError("division by zero")),
     "error", "ZeroDivisionError: division by zero", "report it"),
]  # fmt: skip


@pytest.mark.parametrize(("exc", "kind", "cause", "fix"), [c[1:] for c in CAUSES],
                         ids=[c[0] for c in CAUSES])  # fmt: skip
def test_each_cause_is_classified_with_its_fix(tmp_path, exc, kind, cause, fix) -> None:
    (tmp_path / PLAN_FILE).write_text(json.dumps({"memory_gib": 3.5}))
    failure = classify(exc, tmp_path)
    assert failure.kind == kind
    assert cause in failure.cause and fix in failure.fix
    assert "\n" not in failure.cause


def test_a_cause_found_deeper_in_the_chain_counts(tmp_path) -> None:
    exc = raised(RuntimeError("save failed"), chained_from=OSError(errno.ENOSPC, "full"))
    assert classify(exc, tmp_path).kind == "disk"


def test_a_failure_is_recorded_with_its_traceback_and_summed_up_by_the_launcher(
    tmp_path, monkeypatch
) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    record(raised(TooManyBadSteps("step 4: too many bad steps")), tmp_path)
    monkeypatch.setenv("RANK", "0")
    record(raised(RuntimeError("Connection closed by peer")), tmp_path)
    assert has_failures(tmp_path)
    assert [r["rank"] for r in read_failures(tmp_path)] == [1, 0]
    log = (tmp_path / "logs" / "rank_1.log").read_text()
    assert "Traceback (most recent call last)" in log and "too many bad steps" in log
    host = socket.gethostname()
    assert failure_message(tmp_path, 1).splitlines() == [
        f"training failed on rank 1 of 2 (host {host}): step 4: too many bad steps",
        "  fix: resume with a lower optim.lr or longer warmup",
        f"  traceback: {tmp_path / 'logs' / 'rank_1.log'}",
        f"  then rank 0 stopped too; see {tmp_path / 'logs'}",
    ]


def test_without_records_the_launcher_points_at_torchruns_log(tmp_path) -> None:
    assert failure_message(tmp_path, 137) == (
        "training exited with code 137 and no rank reported a cause (a rank killed by a "
        f"signal?); torchrun's messages are in {tmp_path / 'logs' / 'torchrun.log'}"
    )


def test_the_oom_cause_compares_measured_and_predicted_memory(tmp_path) -> None:
    failure = classify(raised(torch.OutOfMemoryError("out of memory")), tmp_path)
    assert "no plan.json to compare with" in failure.cause
    assert "GiB resident" in failure.cause or "GiB allocated" in failure.cause
