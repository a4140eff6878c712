"""The run's ledger: a record per launch and per job (code, packages, hosts), appended whole,
the first kept across resumes; and the plan of an earlier config kept beside it."""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
from importlib.metadata import version
from pathlib import Path

import pytest

from pretrain.core.inputs.reading import ReadError
from pretrain.core.run import ledger
from pretrain.core.run.ledger import append_record, job_record, read_ledger
from pretrain.core.run.rundir import LEDGER_FILE, PLAN_FILE
from pretrain.core.schema import RecipeConfig, dump_config
from pretrain.launcher.job.run_dir import write_run_dir

CHECKOUT = Path(__file__).resolve().parents[2]


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(CHECKOUT), *args], capture_output=True,
                          text=True, check=True).stdout.strip()  # fmt: skip


def test_each_launch_appends_a_record_and_a_resume_keeps_the_first(tmp_path: Path) -> None:
    cfg = RecipeConfig()
    cfg.run.dir = str(tmp_path / "run")
    launched = {"recipe": "tiny", "overrides": ["optim.lr=1e-3"]}
    write_run_dir(cfg, tmp_path / "run", dump_config(cfg), {"memory_gib": 1.0}, launched)
    first = (tmp_path / "run" / LEDGER_FILE).read_text()
    cfg.parallel.zero = 3  # a resume under another layout
    write_run_dir(cfg, tmp_path / "run", dump_config(cfg), {"memory_gib": 2.0}, launched)
    records, skipped = read_ledger(tmp_path / "run") or ([], -1)
    assert skipped == 0 and [r["kind"] for r in records] == ["launch", "launch"]
    assert (tmp_path / "run" / LEDGER_FILE).read_text().startswith(first)
    assert records[0]["action"] == cfg.action and records[0]["backend"] == "local"
    assert records[0]["packages"]["torch"] == version("torch")
    assert records[0]["packages"]["hydra-core"] == version("hydra-core")
    # The earlier config's plan is kept beside its config.1.yaml, not lost.
    assert json.loads((tmp_path / "run" / "plan.1.json").read_text()) == {"memory_gib": 1.0}
    assert json.loads((tmp_path / "run" / PLAN_FILE).read_text()) == {"memory_gib": 2.0}


def test_a_ledger_that_cannot_be_appended_to_is_refused_before_anything_is_written(
    tmp_path: Path,
) -> None:
    cfg = RecipeConfig()
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / LEDGER_FILE).write_bytes(b"\xff\xfe")
    with pytest.raises(ReadError, match=f"{tmp_path / 'run' / LEDGER_FILE}: not UTF-8 text"):
        write_run_dir(cfg, tmp_path / "run", dump_config(cfg), None, {"overrides": []})
    assert [p.name for p in (tmp_path / "run").iterdir()] == [LEDGER_FILE]


def test_writing_the_run_dir_without_a_launch_leaves_no_ledger(tmp_path: Path) -> None:
    cfg = RecipeConfig()
    write_run_dir(cfg, tmp_path / "run", dump_config(cfg))
    assert read_ledger(tmp_path / "run") is None


def test_a_slurm_job_records_its_node_list_and_a_local_one_this_host(tmp_path: Path) -> None:
    slurm = job_record({"SLURM_JOB_NODELIST": "gpu[01-04]", "SLURM_JOB_ID": "77"}, 32, 500)
    assert slurm["hosts"] == ["gpu[01-04]"] and slurm["slurm_job_id"] == "77"
    assert slurm["kind"] == "job" and slurm["world_size"] == 32 and slurm["start_step"] == 500
    assert job_record({}, 2, 0)["hosts"] == [socket.gethostname()]


@pytest.mark.skipif(not (CHECKOUT / ".git").exists(), reason="not run from a git checkout")
def test_the_code_version_is_this_checkouts_commit_and_dirty_flag() -> None:
    assert ledger.code_version() == {
        "git_commit": _git("rev-parse", "HEAD"),
        "dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
    }


def test_a_package_inside_another_repository_reports_its_installed_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    identity = ["-c", "user.name=t", "-c", "user.email=t@example.com"]
    subprocess.run(["git", "-C", str(tmp_path), *identity, "commit", "-q", "--allow-empty",
                    "-m", "a project with a venv inside"], check=True)  # fmt: skip
    (tmp_path / "venv" / "site-packages").mkdir(parents=True)
    monkeypatch.setattr(ledger, "_CHECKOUT", tmp_path / "venv" / "site-packages")
    assert ledger.code_version() == {"version": version("pretrain")}


def test_an_append_keeps_a_cut_line_and_a_failed_one_changes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / LEDGER_FILE).write_text('{"kind": "launch"}\n{"kind": "jo')  # an older crash
    append_record(tmp_path, {"kind": "job"})
    text = (tmp_path / LEDGER_FILE).read_text()
    assert text == '{"kind": "launch"}\n{"kind": "jo\n{"kind": "job"}\n'
    assert read_ledger(tmp_path) == ([{"kind": "launch"}, {"kind": "job"}], 1)

    def full_disk(*args: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "replace", full_disk)
    with pytest.raises(OSError):
        append_record(tmp_path, {"kind": "job"})
    assert (tmp_path / LEDGER_FILE).read_text() == text
    assert [p.name for p in tmp_path.iterdir()] == [LEDGER_FILE]  # no temporary file left
