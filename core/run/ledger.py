"""The run's ledger, RUN_DIR/ledger.jsonl: what code, on which packages and hosts, launched
and ran the run, one JSON record per line.

The launcher appends a `launch` record each time it writes the run dir (the host it ran on,
which for a local run is the job's host too); each job appends a `job` record when its
first rank starts (the job's hosts, which only the job knows under SLURM, and the step it
resumed from). Records are only ever appended, so a resume keeps the first one; each
append replaces the file whole (core/run/atomic.py), so a reader never finds half of one.
The resolved config, the overrides and the plan sit beside it (config.yaml,
overrides.yaml, plan.json).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from pretrain.core.inputs.reading import MissingFile, json_objects, read_text
from pretrain.core.run.atomic import write_text_atomic
from pretrain.core.run.rundir import LEDGER_FILE

PACKAGES = ("torch", "transformers", "torchao", "transformer-engine", "hydra-core", "omegaconf")
"""The distributions whose versions change what a run computes; those not installed are
left out of a record."""
MAX_LEDGER_BYTES = 16 << 20
"""Bound of the ledger read back (a record is well under 1 KB)."""
_CHECKOUT = Path(__file__).resolve().parents[2]
"""Where the package's folders sit: a git checkout's root when it runs from one."""
_GIT_TIMEOUT_S = 10.0


def _git(*args: str) -> str | None:
    """`git -C CHECKOUT ARGS`'s output, None when git is absent or fails."""
    try:
        done = subprocess.run(
            ["git", "-C", str(_CHECKOUT), *args],
            capture_output=True,
            text=True,
            timeout=_GIT_TIMEOUT_S,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def code_version() -> dict[str, Any]:
    """The code this process runs: `{"git_commit", "dirty"}` from the checkout it runs from
    (dirty: a tracked file differs from the commit), else `{"version"}` of the installed
    package."""
    # An installed package may sit inside someone else's repository (a venv in a project):
    # only a checkout whose root is the package's own counts.
    top, _, commit = (_git("rev-parse", "--show-toplevel", "HEAD") or "").partition("\n")
    if commit and Path(top).resolve() == _CHECKOUT:
        changes = _git("status", "--porcelain", "--untracked-files=no")
        return {"git_commit": commit, "dirty": bool(changes)}
    try:
        return {"version": version("pretrain")}
    except PackageNotFoundError:
        return {"version": "unknown"}


def package_versions() -> dict[str, str]:
    """Python's version and those of PACKAGES that are installed."""
    found = {"python": sys.version.split()[0]}
    for name in PACKAGES:
        # Transformer Engine's wheel is named with an underscore on some indexes.
        for spelling in (name, name.replace("-", "_")):
            try:
                found[name] = version(spelling)
                break
            except PackageNotFoundError:
                continue
    return found


def _base(kind: str) -> dict[str, Any]:
    return {
        "kind": kind,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "code": code_version(),
        "packages": package_versions(),
    }


def launch_record(action: str, backend: str) -> dict[str, Any]:
    """The record of one `pretrain` writing the run dir: the action, the backend, this host."""
    return {**_base("launch"), "action": action, "backend": backend, "host": socket.gethostname()}


def job_hosts(environ: Mapping[str, str]) -> list[str]:
    """The job's hosts: SLURM's node list (as SLURM writes it, e.g. `gpu[01-04]`) inside a
    SLURM job, else this host."""
    nodelist = environ.get("SLURM_JOB_NODELIST", "").strip()
    return [nodelist] if nodelist else [socket.gethostname()]


def job_record(environ: Mapping[str, str], world_size: int, start_step: int) -> dict[str, Any]:
    """The record of one job, taken by its first rank once it knows where it resumes."""
    return {
        **_base("job"),
        "hosts": job_hosts(environ),
        "slurm_job_id": environ.get("SLURM_JOB_ID", ""),
        "world_size": world_size,
        "start_step": start_step,
    }


def append_record(run_dir: Path, record: Mapping[str, Any]) -> None:
    """Append `record` to RUN_DIR/ledger.jsonl, replacing the file whole; what it held is
    kept as it was, a line cut short by an older writer included."""
    path = Path(run_dir) / LEDGER_FILE
    try:
        old = read_text(path, "the run's ledger (JSON lines)", MAX_LEDGER_BYTES)
    except MissingFile:
        old = ""
    if old and not old.endswith("\n"):
        old += "\n"
    write_text_atomic(path, old + json.dumps(dict(record), sort_keys=True) + "\n")


def read_ledger(run_dir: Path) -> tuple[list[dict[str, Any]], int] | None:
    """(the ledger's records in order, how many lines were not one), None when the run dir
    has no ledger (written by a version before it)."""
    path = Path(run_dir) / LEDGER_FILE
    try:
        return json_objects(path, "the run's ledger (JSON lines)", MAX_LEDGER_BYTES)
    except MissingFile:
        return None
