"""Rules of `run.dir`: a directory the launcher may fill with a run, checked before anything
is written.

Refused: the root, the home directory, the current directory (a run dir is a folder of its
own), a path that is a file, a non-empty directory that is not a run dir, a path that
cannot be written, and names longer than the file system allows.
"""

from __future__ import annotations

import os
from pathlib import Path

from pretrain.core.problems import Checks
from pretrain.core.run.rundir import (
    CHECKPOINTS_DIR,
    CONFIG_FILE,
    LAUNCH_LOG,
    LEDGER_FILE,
    LOCAL_SCRIPT,
    LOCK_FILE,
    LOGS_DIR,
    METRICS_FILE,
    PLAN_FILE,
    SLURM_SCRIPT,
)
from pretrain.core.schema import RecipeConfig

RUN_DIR_NAMES = frozenset(
    {CHECKPOINTS_DIR, CONFIG_FILE, LAUNCH_LOG, LEDGER_FILE, LOCAL_SCRIPT, LOCK_FILE, LOGS_DIR,
     METRICS_FILE, PLAN_FILE, SLURM_SCRIPT}
)  # fmt: skip
"""Entries that only a run dir holds: a folder holding nothing else may become one."""
_FIX = "pick another run.dir, e.g. runs/NAME"


def _nearest_existing(path: Path) -> Path:
    while not os.path.exists(path) and path != path.parent:
        path = path.parent
    return path


def _name_problem(path: Path) -> str | None:
    """Why the file system cannot hold this name, if it cannot."""
    existing = _nearest_existing(path)
    try:
        name_max = os.pathconf(existing if existing.is_dir() else existing.parent, "PC_NAME_MAX")
        path_max = os.pathconf(existing if existing.is_dir() else existing.parent, "PC_PATH_MAX")
    except (OSError, ValueError):
        name_max, path_max = 255, 4096
    if len(os.fsencode(path)) >= path_max:
        return f"{len(os.fsencode(path)):,} bytes long, more than the {path_max} a path may have"
    longest = max(path.parts, key=lambda part: len(os.fsencode(part)))
    if len(os.fsencode(longest)) > name_max:
        return f"a name in it is {len(os.fsencode(longest))} bytes, more than {name_max}"
    return None


def _writable_problem(path: Path) -> str | None:
    """Why the run dir cannot be created or written, if it cannot."""
    existing = _nearest_existing(path)
    if existing != path and not existing.is_dir():
        return f"{existing} is a file, so nothing can be created under it"
    try:
        read_only = bool(os.statvfs(existing).f_flag & os.ST_RDONLY)
    except OSError:
        read_only = False
    if read_only:
        return f"{existing} is on a read-only file system"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is not writable by this user"
    return None


def check_run_dir(c: Checks, cfg: RecipeConfig) -> None:
    """`run.dir` can become this run's directory; nothing is created or written."""
    raw = cfg.run.dir or "."
    path = Path(raw).expanduser().absolute()
    problem = _name_problem(path)
    if problem:
        c.add("run.dir", raw, problem, "use a shorter path")
        return
    path = path.resolve()
    special = {Path("/"): "the root directory", Path.home().resolve(): "your home directory",
               Path.cwd().resolve(): "the current directory"}  # fmt: skip
    if path in special:
        c.add("run.dir", raw, f"is {special[path]}; a run dir is a folder of its own", _FIX)
    elif path.exists() and not path.is_dir():
        c.add("run.dir", raw, "is a file, not a directory", _FIX)
    elif path.is_dir() and not (path / CONFIG_FILE).is_file():
        others = sorted(p.name for p in path.iterdir() if p.name not in RUN_DIR_NAMES)
        if others:
            shown = ", ".join(others[:3]) + (", ..." if len(others) > 3 else "")
            c.add("run.dir", raw, f"holds other files ({shown}) and no {CONFIG_FILE}, so it is "
                  "not a run dir; a run would mix its files with them", _FIX)  # fmt: skip
    if not c.reported("run.dir"):
        problem = _writable_problem(path)
        if problem:
            c.add("run.dir", raw, f"cannot be written: {problem}", _FIX)
