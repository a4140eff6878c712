"""Rules of the job script's extension fields: the Python that runs torchrun on each node,
the user's sbatch template, extra #SBATCH lines, setup lines and a container.

Each value reaches the rendered script quoted (see launcher/job/run_dir.py); these rules refuse what
quoting cannot make right: line breaks in one-line values, paths that mean something else
on the node than here, directives the launcher writes itself, setup lines bash cannot parse,
and SLURM-only settings on a local run (they would be silently ignored).
"""

from __future__ import annotations

import re
import shutil
import subprocess

from pretrain.core.inputs.reading import ReadError, read_text
from pretrain.core.problems import Checks
from pretrain.core.schema import RecipeConfig
from pretrain.launcher.assets import SBATCH_TEMPLATE, template_placeholders

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_DIRECTIVE = re.compile(r"--[a-z][a-z0-9-]*(=.*)?")
OWNED_DIRECTIVES = {
    "--job-name": "name", "--nodes": "cluster.nodes", "--ntasks-per-node": "(one per node)",
    "--cpus-per-task": "cluster.cpus_per_task", "--time": "cluster.time",
    "--output": "run.dir", "--error": "run.dir", "--requeue": "(always)",
    "--open-mode": "(append)", "--signal": "cluster.signal_seconds",
    "--gpus-per-node": "cluster.gpus_per_node", "--partition": "cluster.partition",
    "--account": "cluster.account", "--qos": "cluster.qos",
    "--ntasks": "(one per node)", "--ntasks-per-gpu": "(one per node)",
    "--array": "a sweep (-m)", "--chdir": "run.dir (the job runs from it)",
    "--export": "cluster.env", "--export-file": "cluster.env", "--get-user-env": "cluster.env",
    "--no-requeue": "(always requeued)", "--wrap": "cluster.setup (the script is the job)",
    "--input": "(none)",
}  # fmt: skip
"""#SBATCH directives the launcher writes from recipe fields: set the field instead."""
MAX_TEMPLATE_BYTES = 1 << 20


def check_job(c: Checks, cfg: RecipeConfig) -> None:
    """cluster.python, min_nodes, sbatch_template, sbatch_extra, setup and container; on a
    local run, none of the fields only a SLURM job uses (they would be written and
    ignored)."""
    k = cfg.cluster
    _check_python(c, k.python)
    _check_min_nodes(c, k.min_nodes, k.nodes, k.backend)
    if k.backend != "slurm":
        for name, value in (("sbatch_template", k.sbatch_template),
                            ("sbatch_extra", k.sbatch_extra), ("setup", k.setup),
                            ("container.image", k.container.image),
                            ("partition", k.partition), ("account", k.account),
                            ("qos", k.qos), ("cpu_partition", k.cpu_partition)):  # fmt: skip
            if value:
                c.add(f"cluster.{name}", value, "only a SLURM job's script uses it",
                      "use cluster=slurm, or leave it unset for a local run")  # fmt: skip
        return
    if k.sbatch_template:
        _check_template(c, k.sbatch_template)
    for i, directive in enumerate(k.sbatch_extra):
        _check_directive(c, f"cluster.sbatch_extra[{i}]", directive)
    _check_setup(c, k.setup)
    _check_container(c, k.container.image, k.container.mounts)


def _check_min_nodes(c: Checks, min_nodes: int, nodes: int, backend: str) -> None:
    """A job may shrink from `nodes` to `min_nodes` (0: never); only on SLURM, where nodes
    are lost (a local run has one node)."""
    if min_nodes == 0:
        return
    if min_nodes < 0 or min_nodes > nodes:
        c.add("cluster.min_nodes", min_nodes, f"must be between 1 and cluster.nodes={nodes}",
              f"use 1 to {nodes}, or 0 for a job that fails when it loses a node")  # fmt: skip
    elif backend != "slurm":
        c.add("cluster.min_nodes", min_nodes, "a local run has one node, none to lose",
              "use cluster=slurm, or leave it 0")  # fmt: skip


def _check_python(c: Checks, python: str) -> None:
    if _CONTROL.search(python):
        c.add("cluster.python", python, "holds a line break or control character",
              "give one command name or an absolute path")  # fmt: skip
    elif python != python.strip() or " " in python:
        c.add("cluster.python", python, "is run as one program, so a space makes it a name no "
              "node has (arguments cannot be given here)",
              "give one command name or an absolute path; put what it needs in "
              "cluster.setup or cluster.env")  # fmt: skip
    elif "/" in python and not python.startswith("/"):
        c.add("cluster.python", python,
              "a relative path would be looked up from wherever the job starts on the node",
              "give an absolute path, e.g. /opt/venv/bin/python, or a name on PATH such as "
              "python3")  # fmt: skip


def _check_template(c: Checks, path_text: str) -> None:
    from pathlib import Path

    field, path = "cluster.sbatch_template", Path(path_text)
    fix = f"copy {SBATCH_TEMPLATE}, edit it and give its absolute path"
    if not path.is_absolute():
        c.add(field, path_text, "a relative path depends on where pretrain is run", fix)
        return
    try:
        text = read_text(path, "an sbatch template (text)", MAX_TEMPLATE_BYTES)
    except ReadError as err:
        c.add(field, path_text, f"cannot be used: {err.found}", fix)
        return
    expected = template_placeholders(read_text(SBATCH_TEMPLATE, "the shipped sbatch template"))
    found = template_placeholders(text)
    if found != expected:
        parts = []
        if expected - found:
            parts.append("lacks " + ", ".join(f"${{{p}}}" for p in sorted(expected - found)))
        if found - expected:
            parts.append("has unknown " + ", ".join(f"${{{p}}}" for p in sorted(found - expected)))
        c.add(field, path_text, "; ".join(parts),
              f"keep exactly the placeholders of {SBATCH_TEMPLATE}")  # fmt: skip


def _check_directive(c: Checks, field: str, directive: str) -> None:
    name = directive.partition("=")[0]
    if _CONTROL.search(directive) or "\\" in directive:
        c.add(field, directive, "#SBATCH lines cannot carry line breaks, control characters "
              "or backslashes", "write the directive on one line without them")  # fmt: skip
    elif not _DIRECTIVE.fullmatch(directive):
        c.add(field, directive, "not an sbatch long option",
              "write --name=value or --flag, e.g. --constraint=h100 or --exclusive")  # fmt: skip
    elif owner := _owned(name):
        c.add(field, directive, f"the job script owns {owner[0]} (sbatch takes an unambiguous "
              "abbreviation for the whole option)", f"set {owner[1]} instead")  # fmt: skip


def _owned(name: str) -> tuple[str, str] | None:
    """(the owned directive, the field that sets it) that `name` is, or abbreviates."""
    if name in OWNED_DIRECTIVES:
        return name, OWNED_DIRECTIVES[name]
    matches = [d for d in OWNED_DIRECTIVES if len(name) > 3 and d.startswith(name)]
    return (matches[0], OWNED_DIRECTIVES[matches[0]]) if matches else None


def _check_setup(c: Checks, setup: list[str]) -> None:
    for i, line in enumerate(setup):
        if "\n" in line or "\r" in line or "\x00" in line:
            c.add(f"cluster.setup[{i}]", line, "one entry is one line",
                  "split it into several entries")  # fmt: skip
            return
    bash = shutil.which("bash")
    if not setup or bash is None:
        return
    parsed = subprocess.run([bash, "-n"], input="\n".join(setup) + "\n", text=True,
                            capture_output=True, timeout=30, check=False)  # fmt: skip
    if parsed.returncode != 0:
        why = parsed.stderr.strip().splitlines()[0] if parsed.stderr.strip() else "bash -n failed"
        c.add("cluster.setup", setup, f"bash cannot parse it ({why})",
              "fix the shell syntax; each entry is one line of a bash script")  # fmt: skip


def _check_container(c: Checks, image: str, mounts: list[str]) -> None:
    if image and (_CONTROL.search(image) or " " in image or "," in image):
        c.add("cluster.container.image", image, "an image name holds no spaces, commas or "
              "control characters", "give e.g. nvcr.io/nvidia/pytorch:25.01-py3 or "
              "/shared/images/pytorch.sqsh")  # fmt: skip
    if mounts and not image:
        c.add("cluster.container.mounts", mounts, "mounts without an image mount nothing",
              "set cluster.container.image too")  # fmt: skip
    for i, mount in enumerate(mounts):
        parts = mount.split(":")
        ok = 2 <= len(parts) <= 3 and all(p.startswith("/") for p in parts[:2])
        if not ok or "," in mount or _CONTROL.search(mount):
            c.add(f"cluster.container.mounts[{i}]", mount, "not SRC:DST[:FLAGS] with absolute "
                  "paths (and no commas)", "write e.g. /shared/data:/data:ro")  # fmt: skip
