"""A SLURM job's settings against each other, and a run's checkpoints against its disk.

- cluster.signal_seconds (the stop signal's lead on the time limit) must come after the
  job starts and leave time to write the checkpoint the recipe's states size: a lead over
  the limit signals at once, so the job saves, requeues and starts again for ever; a lead
  shorter than the save kills the job mid-save, and every requeue resumes from the same
  older checkpoint.
- The run dir's file system must hold the checkpoints kept at once (`checkpoint.keep`, plus
  the one being written before the oldest is deleted), each sized like the ranks' save.

A checkpoint holds each parameter once (DCP writes a replicated tensor once): its FP32
weights (the master copy under bf16/fp16) and the optimizer's states in
`optim.state_dtype`; the per-rank RNG and loader states are negligible.
"""

from __future__ import annotations

import math
import os
import re
import shutil
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
    if free < new * size:
        c.add("checkpoint.keep", cfg.checkpoint.keep,
              f"{count} checkpoint(s) of {size / GIB:,.2f} GiB are on disk at once (those kept "
              f"and the one being written); {new} more need {new * size / GIB:,.2f} GiB, but "
              f"the file system of run.dir={cfg.run.dir} has {free / GIB:,.2f} GiB free",
              "free space there, lower checkpoint.keep, or pick a run.dir on a larger file "
              "system")  # fmt: skip
