"""The run dir and its job script: the frozen `config.yaml` plus `run.sh` (local) or
`job.sbatch` (SLURM), rendered so that no recipe string ever reaches a shell unquoted.

Two parsers read what is rendered here, and each gets its own quoting:
- bash reads the script body: every recipe value is a `shlex.quote`d word (never inside
  double quotes); environment keys must be identifiers.
- sbatch reads the `#SBATCH` lines with its own small parser: values are double-quoted with
  `"` escaped. It cannot carry a line break or other control character (the directive line
  would end and the rest would run as shell), and a backslash in an output path turns off
  SLURM's `%j` substitution; values holding those are rejected with a JobError.
"""

from __future__ import annotations

import json
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from pretrain.core.inputs.reading import ReadError, read_text
from pretrain.core.run.atomic import write_text_atomic
from pretrain.core.run.ledger import append_record, launch_record, read_ledger
from pretrain.core.run.rundir import (
    CONFIG_FILE,
    LOCAL_SCRIPT,
    LOGS_DIR,
    OVERRIDES_FILE,
    PLAN_FILE,
    PREEMPTED_MARKER,
    SHRUNK_CONFIG_PREFIX,
    SHRUNK_CONFIG_SUFFIX,
    SLURM_SCRIPT,
    shrunk_config,
)
from pretrain.core.schema import RecipeConfig, dump_config
from pretrain.launcher.assets import SBATCH_TEMPLATE, ScriptTemplate, template_placeholders
from pretrain.launcher.plan.shrink import shrinks, shrunk_recipes
from pretrain.launcher.validate.resume import frozen_changes

RDZV_ENDPOINT = "$MASTER_ADDR:$MASTER_PORT"
"""torchrun argument the job script expands to the first node's address and the port."""
RDZV_ID = "$SLURM_JOB_ID"
"""torchrun argument the job script expands to the job's id (the same after a requeue)."""
JOB_PORT = "$((10000 + SLURM_JOB_ID % 20000))"
"""The rendezvous port of cluster.master_port=0, one per job (below Linux's ephemeral ports,
32768+): on one port, a second job on the same first node would join the first job's store
as a client (torchrun's agent does when it cannot bind) and lose it when that job ends."""
NODES_REF = "$NODES"
"""torchrun's --nnodes in a SLURM job: the nodes the job script runs the agents on now."""
CONFIG_REF = "$CONFIG"
"""The config the ranks of a SLURM job read: config.yaml, or the one for the nodes left."""
_SHELL_REFS = {RDZV_ENDPOINT, RDZV_ID, NODES_REF, CONFIG_REF}

AGENT = ["-m", "pretrain.trainer.agent"]
"""The per-node agent, run by `job_python`: torchrun, except that a stop signal after which
the ranks saved is a clean exit (see trainer/agent.py)."""

_ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_DIRECTIVE_NAME = re.compile(r"--[a-z][a-z0-9-]*")


class JobError(ValueError):
    """The run dir or job script cannot be written as asked; the message says how to fix it."""


@dataclass(frozen=True)
class JobFiles:
    """What `write_run_dir` wrote: absolute paths of the run dir, its config and job script."""

    run_dir: Path
    config_path: Path
    script_path: Path


def job_python(cfg: RecipeConfig) -> str:
    """The Python the job runs the agent with: cluster.python, else this launcher's own
    interpreter (so a venv need not be activated, nor torchrun be on PATH)."""
    if cfg.cluster.python:
        return cfg.cluster.python
    return "python3" if cfg.cluster.container.image else sys.executable


def torchrun_args(
    cfg: RecipeConfig, config_path: Path | str, nodes: str | None = None
) -> list[str]:
    """The agent command line (torchrun's arguments) that starts every rank of one node.

    One node: a standalone rendezvous. Several: torchrun's c10d rendezvous hosted on the
    first node (RDZV_ENDPOINT, keyed by RDZV_ID, which the job script expands), so that with
    `cluster.max_restarts` every node's agent restarts its ranks when one rank dies. The
    ranks get `cluster.signal_seconds` to save after a stop signal before they are killed.
    `nodes` (default cluster.nodes) may be a shell reference the job script expands.
    """
    c = cfg.cluster
    per_node = ["--nproc-per-node", str(c.gpus_per_node)]
    if c.max_restarts:
        per_node += ["--max-restarts", str(c.max_restarts)]
    per_node += ["--shutdown-timeout", str(c.signal_seconds)]
    program = ["-m", "pretrain.trainer", str(config_path)]
    if c.nodes == 1:
        return [job_python(cfg), *AGENT, "--standalone", *per_node, *program]
    return [
        job_python(cfg),
        *AGENT,
        "--nnodes",
        nodes or str(c.nodes),
        *per_node,
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        RDZV_ENDPOINT,
        "--rdzv-id",
        RDZV_ID,
        *program,
    ]


def local_command(cfg: RecipeConfig, config_path: Path) -> list[str]:
    """The command that runs every rank of a local job.

    One rank that torchrun would never restart runs as itself: the trainer forms a one-rank
    group without a rendezvous, and skipping the agent (an interpreter of its own that
    imports torch before it starts the rank) saves about 2.4 s of start-up. The launcher
    forwards stop signals to the rank as the agent would (`launcher/job/backends.py`).
    """
    c = cfg.cluster
    if c.nodes == 1 and c.gpus_per_node == 1 and not c.max_restarts:
        return [job_python(cfg), "-m", "pretrain.trainer", str(config_path)]
    return torchrun_args(cfg, config_path)


def job_env(cfg: RecipeConfig) -> dict[str, str]:
    """The variables every rank gets on top of the launcher's environment."""
    env = {
        "OMP_NUM_THREADS": str(cfg.cluster.omp_num_threads),
        # `python -m pretrain.trainer` would put the job's working directory first on sys.path,
        # where
        # a user's own models/ or trainer/ folder would stand in for ours (Python >= 3.11).
        "PYTHONSAFEPATH": "1",
    }
    for key, value in cfg.cluster.env.items():
        if not _ENV_KEY.fullmatch(key):
            raise JobError(
                f"cluster.env: {key!r} is not a valid environment variable name; "
                "use letters, digits and underscores, not starting with a digit"
            )
        if "\x00" in str(value):
            raise JobError(
                f"cluster.env.{key}: the value holds a NUL byte, which no "
                "environment variable can carry"
            )
        env[key] = str(value)
    return env


def _shell_word(arg: str) -> str:
    """One shell word that evaluates to `arg`; only our own references are expanded."""
    return f'"{arg}"' if arg in _SHELL_REFS else shlex.quote(arg)


def _exports(cfg: RecipeConfig) -> str:
    """`export KEY=value` lines for cluster.env (OMP_NUM_THREADS is in the templates)."""
    env = job_env(cfg)
    del env["OMP_NUM_THREADS"]
    return "\n".join(f"export {k}={shlex.quote(v)}" for k, v in env.items())


def omp_num_threads(cfg: RecipeConfig) -> str:
    """The ranks' OMP_NUM_THREADS: cluster.env's if it sets one, else cluster.omp_num_threads."""
    return job_env(cfg)["OMP_NUM_THREADS"]


def _directive(field: str, value: str) -> str:
    """An #SBATCH value quoted for sbatch's parser, or a JobError naming the field."""
    if _CONTROL.search(value) or "\\" in value:
        raise JobError(
            f"{field}={value!r}: #SBATCH lines cannot carry line breaks, control characters "
            "or backslashes; choose a value without them"
        )
    return '"' + value.replace('"', '\\"') + '"'


def render_sbatch(cfg: RecipeConfig, run_dir: Path, config_path: Path) -> str:
    """The sbatch script for this recipe: resources, logs under RUN_DIR/logs, requeue and
    SIGUSR1 before the time limit, and one srun task per node running torchrun."""
    c = cfg.cluster
    optional = []
    if shrinks(cfg):
        # A failed node leaves the allocation instead of ending the job: the script goes on
        # with the nodes left.
        optional.append("#SBATCH --no-kill")
    if c.device != "cpu":
        optional.append(f"#SBATCH --gpus-per-node={c.gpus_per_node}")
    for field in ("partition", "account", "qos"):
        value = getattr(c, field)
        if value:
            optional.append(f"#SBATCH --{field}={_directive(f'cluster.{field}', value)}")
    optional += [_extra_directive(i, d) for i, d in enumerate(c.sbatch_extra)]
    _directive("run.dir", str(run_dir))  # name the run dir itself if it cannot be used
    # SLURM expands %j (job id) in the output path; a literal % is written %%.
    log_pattern = str(Path(run_dir) / LOGS_DIR).replace("%", "%%") + "/slurm-%j.out"
    agent = " ".join(_shell_word(a) for a in torchrun_args(cfg, CONFIG_REF, NODES_REF))
    # The user's setup lines are shell by design; they run before the agent on each node.
    setup = "".join(f"{line}\n" for line in c.setup)
    node_script = f'trap "" USR1; {setup}exec {agent}'
    values = {
        "job_name": _directive("name", cfg.name),
        "nodes": str(c.nodes),
        "cpus_per_task": str(c.cpus_per_task),
        "time": _directive("cluster.time", c.time),
        "log_pattern": _directive("run.dir", log_pattern),
        "signal_seconds": str(c.signal_seconds),
        "optional_directives": "\n".join(optional),
        "omp_num_threads": shlex.quote(omp_num_threads(cfg)),
        "env_exports": _exports(cfg),
        "master_port": str(c.master_port) if c.master_port else JOB_PORT,
        "config_path": shlex.quote(str(config_path)),
        "node_command": shlex.quote(node_script),
        "srun_options": " ".join(shlex.quote(o) for o in container_options(cfg, run_dir)),
        "preempted_path": shlex.quote(str(Path(run_dir) / PREEMPTED_MARKER)),
        "min_nodes": str(c.min_nodes if shrinks(cfg) else c.nodes),
        "shrunk_config_prefix": shlex.quote(str(Path(run_dir) / SHRUNK_CONFIG_PREFIX)),
        "shrunk_config_suffix": shlex.quote(SHRUNK_CONFIG_SUFFIX),
    }
    path = Path(c.sbatch_template) if c.sbatch_template else SBATCH_TEMPLATE
    template = ScriptTemplate(read_text(path, "an sbatch template (text)"))
    mismatch = sorted(template_placeholders(template.template) ^ values.keys())
    if mismatch:
        raise JobError(f"{path} and the renderer disagree on placeholders: {mismatch}")
    return template.safe_substitute(values)


def _extra_directive(index: int, directive: str) -> str:
    """One of cluster.sbatch_extra as an #SBATCH line, its value quoted for sbatch."""
    name, eq, value = directive.partition("=")
    if not _DIRECTIVE_NAME.fullmatch(name):
        raise JobError(f"cluster.sbatch_extra[{index}]={directive!r}: not --name=value or --flag")
    if not eq:
        return f"#SBATCH {name}"
    return f"#SBATCH {name}={_directive(f'cluster.sbatch_extra[{index}]', value)}"


def container_options(cfg: RecipeConfig, run_dir: Path) -> list[str]:
    """srun's pyxis options for cluster.container: the image, the run dir and the user's
    mounts, the job's working directory; none without an image."""
    box = cfg.cluster.container
    if not box.image:
        return []
    mounts = [f"{run_dir}:{run_dir}", *box.mounts]
    return [
        f"--container-image={box.image}",
        f"--container-mounts={','.join(mounts)}",
        "--container-workdir=" + str(Path.cwd()),
    ]


def render_local(cfg: RecipeConfig, config_path: Path) -> str:
    """run.sh: the same command and environment that `run_local` uses."""
    command = " ".join(shlex.quote(a) for a in local_command(cfg, config_path))
    exports = "\n".join(f"export {k}={shlex.quote(v)}" for k, v in job_env(cfg).items())
    return (
        "#!/bin/bash\n"
        "# Rendered by launcher/job/run_dir.py: runs every rank of this recipe on this machine.\n"
        "set -euo pipefail\n"
        f"{exports}\n"
        f"exec {command}\n"
    )


def _text_or_none(path: Path) -> str | None:
    """A file's text, None where it is not a readable text file (it is then replaced)."""
    try:
        return read_text(path, "a file the launcher wrote")
    except ReadError:
        return None


def _write_atomic(path: Path, text: str, mode: int) -> None:
    """Write `text` to `path` so that readers see the old file or the new, never half of one
    (see core/run/atomic.py); a file that already holds `text` is left untouched."""
    if path.is_file() and _text_or_none(path) == text:
        return
    write_text_atomic(path, text, mode)


def write_run_dir(
    cfg: RecipeConfig,
    run_dir: Path,
    config_yaml: str,
    plan: dict | None = None,
    launched: dict | None = None,
) -> JobFiles:
    """Create the run dir with its frozen config.yaml, job script (run.sh or job.sbatch),
    the plan (plan.json) and how it was launched (overrides.yaml: `launched`, the recipe's
    name and the command line's overrides), leaving files that already hold the same text
    untouched. A launch (`launched` given) appends its record to the ledger
    (core/run/ledger.py).

    A run dir belongs to one config: if it already holds a config.yaml that differs in what
    is trained (see launcher/validate/resume.py), nothing is written and a JobError says so. A
    change of layout or length replaces it, the old one kept as config.N.yaml (and its
    overrides and plan as overrides.N.yaml and plan.N.json). A file system error
    (no space, no permission) is a JobError of one line.
    """
    try:
        resolved = Path(run_dir).expanduser().resolve()
        return _write_run_dir(cfg, resolved, config_yaml, plan, launched)
    except OSError as err:
        where = f" {err.filename}" if err.filename else ""
        raise JobError(
            f"cannot write the run dir{where}: {err.strerror or err}; free space or fix the "
            "permissions, or pick another run.dir"
        ) from None


@dataclass(frozen=True)
class _Rendered:
    files: JobFiles
    script: str
    old_yaml: str | None


def _render_run_dir(cfg: RecipeConfig, run_dir: Path, config_yaml: str) -> _Rendered:
    """Everything write_run_dir would write, or the JobError that refuses it; reads only."""
    backend = cfg.cluster.backend
    if backend not in ("local", "slurm"):
        raise JobError(f"cluster.backend={backend!r}: use local or slurm")
    if backend == "local" and cfg.cluster.nodes != 1:
        raise JobError(
            f"cluster.nodes={cfg.cluster.nodes} with cluster.backend=local: the "
            "local backend runs one node; use cluster=slurm or cluster.nodes=1"
        )
    config_path = run_dir / CONFIG_FILE
    script_path = run_dir / (LOCAL_SCRIPT if backend == "local" else SLURM_SCRIPT)
    if backend == "local":
        script = render_local(cfg, config_path)
    else:
        script = render_sbatch(cfg, run_dir, config_path)
    old_yaml = read_text(config_path, "the run's config.yaml") if config_path.exists() else None
    read_ledger(run_dir)  # one the launch could not append to is refused before any write
    if old_yaml is not None and old_yaml != config_yaml:
        frozen = frozen_changes(old_yaml, config_yaml)
        if frozen:
            raise JobError(
                f"{config_path} holds a different config: a run dir belongs to one recipe; a "
                f"resumed run may change its layout and train.steps, not {', '.join(frozen)}. "
                f"Pick a new run.dir=... or remove {run_dir} to start over."
            )
    return _Rendered(JobFiles(run_dir, config_path, script_path), script, old_yaml)


def check_run_dir(cfg: RecipeConfig, run_dir: Path, config_yaml: str) -> None:
    """Raise the JobError write_run_dir would raise before writing anything; write nothing."""
    try:
        _render_run_dir(cfg, Path(run_dir).expanduser().resolve(), config_yaml)
    except OSError as err:
        raise JobError(f"cannot read the run dir {run_dir}: {err.strerror or err}") from None


def finished_message(cfg: RecipeConfig, run_dir: Path) -> str | None:
    """What to tell a user who starts a run its run dir already finished (its newest
    complete checkpoint is at train.steps or beyond), None when there is training left."""
    from pretrain.core.run.checkpoint_files import complete_checkpoints
    from pretrain.core.run.rundir import CHECKPOINTS_DIR

    done = complete_checkpoints(Path(run_dir) / CHECKPOINTS_DIR)
    if not done or done[-1][0] < cfg.train.steps:
        return None
    step = done[-1][0]
    return (
        f"run dir {run_dir} already finished: its newest checkpoint is step {step} of "
        f"train.steps={cfg.train.steps}, so there is nothing to train. To train on from "
        f"step {step}, raise train.steps; for a new run, give another run.dir "
        f"(e.g. run.dir={run_dir}-2); to look at this one: pretrain status {run_dir}"
    )


def _write_run_dir(
    cfg: RecipeConfig,
    run_dir: Path,
    config_yaml: str,
    plan: dict | None,
    launched: dict | None,
) -> JobFiles:
    # Render before touching the disk, so a rejected value leaves no half-made run dir.
    rendered = _render_run_dir(cfg, run_dir, config_yaml)
    files, old_yaml = rendered.files, rendered.old_yaml
    (run_dir / LOGS_DIR).mkdir(parents=True, exist_ok=True)
    if old_yaml is not None and old_yaml != config_yaml:
        # Keep every config the run dir was trained under: config.1.yaml, config.2.yaml, ...
        n = 1 + sum(1 for _ in run_dir.glob("config.*.yaml"))
        _write_atomic(run_dir / f"config.{n}.yaml", old_yaml, 0o644)
        if (run_dir / OVERRIDES_FILE).is_file():
            old_overrides = read_text(run_dir / OVERRIDES_FILE, "the run's overrides.yaml")
            _write_atomic(run_dir / f"overrides.{n}.yaml", old_overrides, 0o644)
        if (run_dir / PLAN_FILE).is_file():
            old_plan = read_text(run_dir / PLAN_FILE, "the run's plan.json", 64 << 20)
            _write_atomic(run_dir / f"plan.{n}.json", old_plan, 0o644)
    _write_atomic(files.config_path, config_yaml, 0o644)
    for nodes, (shrunk, _) in shrunk_recipes(cfg).items():
        _write_atomic(run_dir / shrunk_config(nodes), dump_config(shrunk), 0o644)
    _write_atomic(files.script_path, rendered.script, 0o755)
    if launched is not None:
        text = json.dumps(launched, indent=1) + "\n"
        _write_atomic(run_dir / OVERRIDES_FILE, text, 0o644)  # JSON is YAML
    if plan is not None:
        _write_atomic(run_dir / PLAN_FILE, json.dumps(plan, indent=1) + "\n", 0o644)
    if launched is not None:
        # Last, once the files it speaks of are in place.
        append_record(run_dir, launch_record(cfg.action, cfg.cluster.backend))
    return files
