"""A SLURM job's settings against each other and against its partition's limits, and a
run's checkpoints against its disk.

- cluster.signal_seconds (the stop signal's lead on the time limit) must come after the
  job starts and leave time to write the checkpoint the recipe's states size: a lead over
  the limit signals at once, so the job saves, requeues and starts again for ever; a lead
  shorter than the save kills the job mid-save, and every requeue resumes from the same
  older checkpoint.
- The run dir's file system must hold the checkpoints kept at once (`checkpoint.keep`, plus
  the one being written before the oldest is deleted), each sized like the ranks' save.
- The partition's limits, as `scontrol` and `sinfo` tell them, asked before the script is
  written: a job SLURM would leave pending for ever (a time limit over the partition's
  MaxTime, more nodes than it has or allows, more CPUs or GPUs per task than any of its
  nodes) is refused with the field to change. Where the commands are missing or cannot
  reach a controller (a login node without SLURM_CONF, a laptop writing a script), the
  check is skipped with a line that says so.

A checkpoint holds each parameter once (DCP writes a replicated tensor once): its FP32
weights (the master copy under bf16/fp16) and the optimizer's states in
`optim.state_dtype`; the per-rank RNG and loader states are negligible.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pretrain.core.hardware import GIB
from pretrain.core.optim_states import state_bytes, state_tensors
from pretrain.core.problems import Checks
from pretrain.core.run.checkpoint_files import complete_checkpoints
from pretrain.core.run.rundir import CHECKPOINTS_DIR
from pretrain.core.schema import RecipeConfig
from pretrain.models.flops import count_params

WEIGHT_BYTES = 4
"""Bytes per parameter of the saved weights (FP32: the master copy under mixed precision)."""
CHECKPOINT_WRITE_GBS = 2.0
"""GB/s one node is assumed to write a checkpoint at (a parallel file system's client share;
the trainer logs the measured save time); the nodes write their shards at once."""
SAVE_MARGIN_S = 30
"""Seconds a stop signal's lead needs beyond the save: the step in flight finishes first,
and slurmctld sends the signal up to about 30 s off its time."""
DISK_MARGIN = 1.05
"""A save needs its tensors' bytes plus 5% (DCP metadata, pickled objects), as the
trainer's own check before each save counts it."""
_TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")


def checkpoint_bytes(cfg: RecipeConfig) -> float:
    """Bytes of one checkpoint of the recipe: every parameter's weights and optimizer states."""
    moments = state_tensors(cfg.optim)[0]  # the blocks' matrices, which dominate
    per_param = WEIGHT_BYTES + moments * state_bytes(cfg.optim.state_dtype)
    return count_params(cfg.model).total * per_param


def save_seconds(cfg: RecipeConfig) -> float:
    """Seconds the job's nodes take to write one checkpoint at CHECKPOINT_WRITE_GBS each."""
    return checkpoint_bytes(cfg) / (cfg.cluster.nodes * CHECKPOINT_WRITE_GBS * 1e9)


def slurm_seconds(text: str) -> int | None:
    """An sbatch time limit in seconds ([D-]HH:MM:SS, MM, MM:SS, D-HH, D-HH:MM); None for
    UNLIMITED, 0 (no limit to sbatch too) or what sbatch would not take."""
    match = _TIME.match(text.strip())
    if match is None:
        return None
    days, first, second, third = (int(g) if g else None for g in match.groups())
    if days is not None:  # D-HH[:MM[:SS]]
        seconds = days * 86400 + (first or 0) * 3600 + (second or 0) * 60 + (third or 0)
    elif third is not None:  # HH:MM:SS
        seconds = (first or 0) * 3600 + (second or 0) * 60 + third
    else:
        seconds = (first or 0) * 60 + (second or 0)  # MM or MM:SS
    return seconds or None  # sbatch takes a limit of 0 as none


def check_signal_lead(c: Checks, cfg: RecipeConfig) -> None:
    """cluster.signal_seconds against cluster.time and the checkpoint's save time (SLURM)."""
    k = cfg.cluster
    limit = slurm_seconds(k.time)
    if k.backend != "slurm" or k.signal_seconds <= 0 or k.nodes < 1:
        return
    if limit is not None and k.signal_seconds >= limit:
        c.add("cluster.signal_seconds", k.signal_seconds,
              f"the stop signal would come {k.signal_seconds} s before a time limit of "
              f"cluster.time={k.time} ({limit} s), i.e. as the job starts: it would save, "
              "requeue and start again for ever",
              f"use a lead below {limit} s, or raise cluster.time")  # fmt: skip
        return
    needed = math.ceil(save_seconds(cfg)) + SAVE_MARGIN_S
    if k.signal_seconds < needed:
        size = checkpoint_bytes(cfg) / GIB
        c.add("cluster.signal_seconds", k.signal_seconds,
              f"a checkpoint of this recipe is {size:,.1f} GiB, about "
              f"{save_seconds(cfg):,.0f} s to write from {k.nodes} node(s) at "
              f"{CHECKPOINT_WRITE_GBS:g} GB/s each, plus {SAVE_MARGIN_S} s for the step in "
              "flight: a job stopped with this lead is killed mid-save and every requeue "
              "resumes from the checkpoint before",
              f"use cluster.signal_seconds >= {needed}")  # fmt: skip


def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def checkpoints_at_once(cfg: RecipeConfig) -> int:
    """Checkpoints on disk at the peak: those kept plus the one being written, no more than
    the run saves (every `checkpoint.every` steps and at the end)."""
    every = cfg.checkpoint.every
    saves = math.ceil(cfg.train.steps / every) if every > 0 else 1
    return max(1, min(cfg.checkpoint.keep + 1, saves))


def hf_folder_bytes(cfg: RecipeConfig) -> float:
    """Bytes the Hugging Face folders of `checkpoint.hf_every` take on disk at the peak: the
    weights of those kept, and twice those of the one being written (its shards and the
    files assembled from them)."""
    every = cfg.checkpoint.hf_every
    saves = cfg.train.steps // every if every > 0 else 0
    if saves == 0:
        return 0.0
    kept = min(cfg.checkpoint.keep, saves - 1)
    return (kept + 2) * count_params(cfg.model).total * WEIGHT_BYTES


def check_disk_room(c: Checks, cfg: RecipeConfig) -> None:
    """The run dir's file system holds the checkpoints the run keeps at once (a refusal:
    the trainer would otherwise fail at its first save that does not fit, hours in)."""
    if cfg.checkpoint.keep < 1 or cfg.train.steps < 1:
        return
    run_dir = Path(os.path.expanduser(cfg.run.dir or ".")).absolute()
    try:
        free = shutil.disk_usage(_nearest_existing(run_dir)).free
        # A resumed run's checkpoints already take their room: only the rest is new.
        held = len(complete_checkpoints(run_dir / CHECKPOINTS_DIR))
    except OSError:
        return  # the run dir's own rules say why it cannot be used
    count, size = checkpoints_at_once(cfg), checkpoint_bytes(cfg) * DISK_MARGIN
    new = max(1, count - held)
    hf = hf_folder_bytes(cfg) * DISK_MARGIN
    also = f" and Hugging Face folders of {hf / GIB:,.2f} GiB (checkpoint.hf_every)" if hf else ""
    if free < new * size + hf:
        c.add("checkpoint.keep", cfg.checkpoint.keep,
              f"{count} checkpoint(s) of {size / GIB:,.2f} GiB are on disk at once (those kept "
              f"and the one being written); {new} more need {new * size / GIB:,.2f} GiB{also}, "
              f"but the file system of run.dir={cfg.run.dir} has {free / GIB:,.2f} GiB free",
              "free space there, lower checkpoint.keep, or pick a run.dir on a larger file "
              "system")  # fmt: skip


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
