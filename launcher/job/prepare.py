"""`action=prepare`: tokenize the recipe's data here, or submit it as a CPU-only SLURM job.

The resolved recipe is written to RUN_DIR/prepare.yaml (the training job's config.yaml is
left alone) and `python -m pretrain.dataprep.prepare` runs on it: in the foreground for a local
cluster, as RUN_DIR/prepare.sbatch (one task, `data.workers` CPUs or cluster.cpus_per_task,
no GPUs, cluster.cpu_partition) for SLURM. Preparation is resumable, so a stopped job
resubmitted continues where it was.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import threading
from pathlib import Path

from pretrain.core.inputs.reading import read_text
from pretrain.core.run import run_lock
from pretrain.core.run.lifeline import child_dies_with_us
from pretrain.core.run.rundir import LOGS_DIR, PREPARE_CONFIG, PREPARE_SCRIPT
from pretrain.core.schema import RecipeConfig, dump_config
from pretrain.launcher.assets import PREPARE_TEMPLATE as TEMPLATE
from pretrain.launcher.assets import ScriptTemplate
from pretrain.launcher.job.backends import (
    LaunchError,
    SubmittedJob,
    submit_slurm,
    wait_forwarding_signals,
)
from pretrain.launcher.job.run_dir import (
    JobError,
    JobFiles,
    _directive,
    _exports,
    _write_atomic,
    job_python,
)
from pretrain.launcher.output import get_logger

LOG = get_logger(__name__)


def render_prepare_sbatch(cfg: RecipeConfig, run_dir: Path, config_path: Path) -> str:
    """The CPU-only sbatch script that prepares the recipe's data."""
    c = cfg.cluster
    optional = []
    partition = c.cpu_partition or c.partition
    for field, value in (("partition", partition), ("account", c.account), ("qos", c.qos)):
        if value:
            name = "cluster.cpu_partition" if field == "partition" and c.cpu_partition else ""
            optional.append(f"#SBATCH --{field}={_directive(name or f'cluster.{field}', value)}")
    log_pattern = str(run_dir / LOGS_DIR).replace("%", "%%") + "/slurm-%j.out"
    values = {
        "job_name": _directive("name", f"{cfg.name}-prepare"),
        "cpus_per_task": str(cfg.data.workers or c.cpus_per_task),
        "time": _directive("cluster.time", c.time),
        "log_pattern": _directive("run.dir", log_pattern),
        "optional_directives": "\n".join(optional),
        "env_exports": _exports(cfg),
        "config_path": shlex.quote(str(config_path)),
        "python": shlex.quote(job_python(cfg)),
    }
    template = ScriptTemplate(read_text(TEMPLATE, "the shipped prepare job template"))
    found = {m["named"] or m["braced"] for m in template.pattern.finditer(template.template)}
    found.discard(None)
    if found != values.keys():
        raise JobError(
            f"{TEMPLATE} and the renderer disagree on placeholders: {sorted(found ^ values.keys())}"
        )
    return template.safe_substitute(values)


def write_prepare_files(cfg: RecipeConfig, run_dir: Path) -> JobFiles:
    """RUN_DIR/prepare.yaml, and prepare.sbatch for SLURM (rendered before anything is
    written, so a value the script cannot carry leaves nothing behind)."""
    run_dir = Path(run_dir).expanduser().resolve()
    config_path = run_dir / PREPARE_CONFIG
    script_path = run_dir / PREPARE_SCRIPT
    script = None
    if cfg.cluster.backend == "slurm":
        script = render_prepare_sbatch(cfg, run_dir, config_path)
    (run_dir / LOGS_DIR).mkdir(parents=True, exist_ok=True)
    _write_atomic(config_path, dump_config(cfg), 0o644)
    if script is not None:
        _write_atomic(script_path, script, 0o755)
    return JobFiles(run_dir=run_dir, config_path=config_path, script_path=script_path)


PREPARE_GRACE_S = 5.0
"""Seconds the preparation has, after Ctrl-C or SIGTERM, to stop; its process group (the
tokenizer workers included) is killed after that. Units are committed whole, so what was
finished is kept either way and the same command resumes."""


def run_prepare_here(files: JobFiles) -> tuple[int, str | None]:
    """Prepare in the foreground with this Python, holding the run dir's lock; its exit code.

    As `run` does with its ranks: the child (and its tokenizer workers) runs in its own
    process group that dies with this process, and Ctrl-C, SIGTERM and SIGHUP are forwarded
    to the group, so the preparation stops after its current unit and keeps the finished
    shards (the same command resumes). (its exit code, 128 + N for a child killed by
    signal N; the name of the signal that stopped it, None if none did)."""
    holder = run_lock.LockHolder.this_process()
    try:
        run_lock.acquire(files.run_dir, holder)
    except run_lock.RunDirInUse as err:
        raise LaunchError(str(err)) from None
    try:
        command = [sys.executable, "-m", "pretrain.dataprep.prepare", str(files.config_path)]
        LOG.debug(f"running: {shlex.join(command)}")
        proc = subprocess.Popen(
            command,
            # As the ranks do: the working directory's folders never stand in for ours.
            env={**os.environ, "PYTHONSAFEPATH": "1"},
            start_new_session=True,
            preexec_fn=child_dies_with_us(),
        )
        stopped: list[str] = []
        code = wait_forwarding_signals(proc, threading.Event(), stopped, PREPARE_GRACE_S)
    finally:
        run_lock.release(files.run_dir, holder.token)
    return (128 - code if code < 0 else code), (stopped[0] if stopped else None)


def submit_prepare(files: JobFiles) -> SubmittedJob:
    """Queue RUN_DIR/prepare.sbatch."""
    return submit_slurm(files)
