"""Parity harness: train the tiny model under a layout and read back its loss curve.

Each run goes through the real `pretrain` CLI (Hydra compose, validation, run dir,
torchrun with gloo on CPU), so a layout is tested exactly as a user would launch it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

FP32_TOLERANCE = 1e-5
"""Relative per-step difference an FP32 layout may show against the one-process run: what
reordered FP32 sums leave (measured differences are around 1e-7)."""

# Small enough to build and train in seconds, large enough that every layout has
# gradient accumulation (global batch 8 = micro-batch 2 x accumulation x dp).
BASE_OVERRIDES = (
    "model.vocab_size=512",
    "model.dim=64",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.ffn_dim=192",
    "model.n_layers=4",
    "data.max_bytes=400000",
    "train.steps=8",
    "train.seq_len=64",
    "train.micro_batch=2",
    "train.global_batch=8",
    "schedule.warmup_steps=2",
    "optim.lr=3e-3",
    "logging.log_every=1",
    "logging.wandb=disabled",
)


@dataclass(frozen=True)
class Curve:
    """Per-step metrics of one run, as logged to metrics.jsonl."""

    loss: list[float]
    grad_norm: list[float]


def run_pretrain(
    run_dir: Path,
    overrides: list[str],
    nproc: int,
    timeout: float = 300,
    recipe: str = "tiny",
    base: tuple[str, ...] = BASE_OVERRIDES,
) -> Curve:
    """Train `recipe` through the CLI with `nproc` CPU ranks and return the logged curve.

    `base` shrinks the recipe to the harness model; pass () to train the recipe as shipped.
    """
    result = launch(run_dir, overrides, nproc, timeout, recipe, base)
    if result.returncode != 0:
        log = run_dir.parent / f"{run_dir.name}.log"
        raise AssertionError(
            f"pretrain failed ({result.returncode}), full output in {log}:\n{result.stderr[-3000:]}"
        )
    return read_curve(run_dir / "metrics.jsonl")


def launch(
    run_dir: Path,
    overrides: list[str],
    nproc: int,
    timeout: float = 300,
    recipe: str = "tiny",
    base: tuple[str, ...] = BASE_OVERRIDES,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """The pretrain CLI on `nproc` CPU ranks, failed or not; its output goes to
    RUN_DIR.log beside the run dir when it fails."""
    cmd = [
        sys.executable,
        "-m",
        "launcher",
        "--config-name",
        recipe,
        *base,
        f"cluster.gpus_per_node={nproc}",
        f"run.dir={run_dir}",
        *overrides,
    ]
    full_env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env)
    if result.returncode != 0:
        (run_dir.parent / f"{run_dir.name}.log").write_text(result.stdout + result.stderr)
    return result


def read_curve(path: Path) -> Curve:
    """The loss and gradient-norm curves of a metrics.jsonl file (a step logged again after
    a resume counts once, as logged last)."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    last = {r["step"]: r for r in rows}
    rows = [last[step] for step in sorted(last)]
    return Curve(loss=[r["loss"] for r in rows], grad_norm=[r["grad_norm"] for r in rows])


def max_relative_difference(a: list[float], b: list[float]) -> float:
    """Largest |a - b| / |b| over steps; the curves must have the same length."""
    assert len(a) == len(b), f"curves differ in length: {len(a)} vs {len(b)}"
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))
