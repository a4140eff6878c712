"""A SLURM job's request against its partition's limits, as `scontrol` and `sinfo` tell them.

Asked before the script is written, so that a job SLURM would leave pending for ever (a
time limit over the partition's MaxTime, more nodes than it has or allows, more CPUs or
GPUs per task than any of its nodes) is refused with the field to change. Where the
commands are missing or cannot reach a controller (a login node without SLURM_CONF, a
laptop writing a script), the check is skipped with a line that says so.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass

from pretrain.core.problems import Checks
from pretrain.core.schema import RecipeConfig
from pretrain.launcher.validate.job_limits import slurm_seconds

Runner = Callable[[list[str]], str | None]
"""Runs a SLURM client command: its stdout, None when it cannot (missing, failing, slow)."""
QUERY_TIMEOUT_S = 15
_GPUS = re.compile(r"gpu(?::[A-Za-z0-9_.-]+)?:(\d+)")


@dataclass(frozen=True)
class PartitionLimits:
    """What a partition allows one job; None where it sets no limit or does not say."""

    name: str
    max_seconds: int | None
    max_nodes: int | None
    cpus_per_node: int | None
    """The most CPUs any node of the partition has."""
    gpus_per_node: int | None
    """The most GPUs any node of the partition has (0: none has a gpu GRES)."""


def run_client(argv: list[str]) -> str | None:
    """`argv`'s stdout, or None if the command is missing, fails or takes too long."""
    if shutil.which(argv[0]) is None:
        return None
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=QUERY_TIMEOUT_S,
                              check=False)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def _whole(text: str | None) -> int | None:
    return int(text) if text is not None and text.isdigit() else None


def partition_limits(partition: str, run: Runner = run_client) -> PartitionLimits | None:
    """The limits of `partition` (empty: the default one); None when SLURM cannot tell."""
    shown = run(
        ["scontrol", "show", "partition", "--oneliner", *([partition] if partition else [])]
    )
    if not shown:
        return None
    rows = [dict(f.split("=", 1) for f in line.split() if "=" in f) for line in shown.splitlines()]
    rows = [r for r in rows if "PartitionName" in r]
    if not partition:
        rows = [r for r in rows if r.get("Default") == "YES"]
    if not rows:
        return None
    row = rows[0]
    name = row["PartitionName"]
    max_nodes = [n for n in (_whole(row.get("MaxNodes")), _whole(row.get("TotalNodes"))) if n]
    nodes = run(["sinfo", "--noheader", "--partition", name, "--format", "%c|%G"]) or ""
    cpus, gpus = [], []
    for line in nodes.splitlines():
        cpu_text, _, gres = line.strip().partition("|")
        if cpu_text.rstrip("+").isdigit():
            cpus.append(int(cpu_text.rstrip("+")))
        gpus.append(sum(int(n) for n in _GPUS.findall(gres)))
    return PartitionLimits(
        name=name,
        max_seconds=slurm_seconds(row.get("MaxTime", "UNLIMITED")),
        max_nodes=min(max_nodes) if max_nodes else None,
        cpus_per_node=max(cpus) if cpus else None,
        gpus_per_node=max(gpus) if gpus else None,
    )


def check_partition(c: Checks, cfg: RecipeConfig, run: Runner = run_client) -> str | None:
    """Refuse what the partition cannot give the job; a line saying the check was skipped
    when SLURM cannot tell, None otherwise."""
    k = cfg.cluster
    limits = partition_limits(k.partition, run)
    if limits is None:
        which = f"cluster.partition={k.partition}" if k.partition else "the default partition"
        return (f"{which}'s limits not checked: scontrol cannot tell here (no SLURM client or "
                "controller); sbatch will")  # fmt: skip
    where = f"partition {limits.name}"
    fix = f"or pick another cluster.partition (sinfo lists them; this one is {limits.name})"
    asked = slurm_seconds(k.time)
    if limits.max_seconds is not None and (asked is None or asked > limits.max_seconds):
        c.add("cluster.time", k.time, f"over {where}'s MaxTime of {limits.max_seconds:,} s; "
              "the job would pend for ever", f"use cluster.time <= {limits.max_seconds} s, "
              f"{fix}")  # fmt: skip
    if limits.max_nodes is not None and k.nodes > limits.max_nodes:
        c.add("cluster.nodes", k.nodes, f"{where} gives a job at most {limits.max_nodes} "
              "node(s)", f"use cluster.nodes <= {limits.max_nodes}, {fix}")  # fmt: skip
    if limits.cpus_per_node is not None and k.cpus_per_task > limits.cpus_per_node:
        c.add("cluster.cpus_per_task", k.cpus_per_task, f"the job runs one task per node, and "
              f"no node of {where} has more than {limits.cpus_per_node} CPUs",
              f"use cluster.cpus_per_task <= {limits.cpus_per_node}, {fix}")  # fmt: skip
    on_gpus = k.device == "cuda"
    if on_gpus and limits.gpus_per_node is not None and k.gpus_per_node > limits.gpus_per_node:
        c.add("cluster.gpus_per_node", k.gpus_per_node, f"no node of {where} has more than "
              f"{limits.gpus_per_node} GPU(s)", f"use cluster.gpus_per_node <= "
              f"{limits.gpus_per_node} (and more cluster.nodes), {fix}")  # fmt: skip
    return None
