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
"""Relative per-step difference an FP32 layout may show against the one-process run in the
loss and the validation loss: what reordered FP32 sums leave (measured differences are
around 1e-7)."""
GRAD_NORM_TOLERANCE = 1e-4
"""The same for the gradient norm, a sum of squares over every parameter that amplifies the
reordering once the weights have moved apart by rounding: at step 1 (identical weights)
every layout agrees within 3e-7, by step 8 tensor parallelism (tp2, tp2_sp, pp2 x tp2 x sp)
differs by up to 4.3e-5 while its losses still agree within 1e-7."""

# Small enough to build and train in seconds, large enough that every layout has
# gradient accumulation (global batch 8 = micro-batch 2 x accumulation x dp). The validation
# loss (2 global batches of the held-out documents) is evaluated at steps 4 and 8.
BASE_OVERRIDES = (
    "model.vocab_size=512",
    "model.dim=64",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.ffn_dim=192",
    "model.n_layers=4",
    "data.max_bytes=400000",
    "data.val_fraction=0.1",
    "eval.every=4",
    "eval.batches=2",
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
    val_loss: list[float]
    """At the steps that evaluated, in order."""


def launch(
    run_dir: Path,
    overrides: list[str],
    nproc: int,
    timeout: float = 300,
    recipe: str = "tiny",
    base: tuple[str, ...] = BASE_OVERRIDES,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """Train `recipe` through the CLI with `nproc` CPU ranks; the result, failed or not (its
    output is kept beside the run dir as RUN.log). `env` adds environment variables."""
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
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env)
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    (run_dir.parent / f"{run_dir.name}.log").write_text(result.stdout + result.stderr)
    return result


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
    The output of every run is written next to the run dir (RUN_DIR.log).
    """
    result = launch(run_dir, overrides, nproc, timeout, recipe, base)
    if result.returncode != 0:
        log = run_dir.parent / f"{run_dir.name}.log"
        raise AssertionError(
            f"pretrain failed ({result.returncode}), full output in {log}:\n{result.stderr[-3000:]}"
        )
    return read_curve(run_dir / "metrics.jsonl")


def logged_losses(run_dir: Path) -> dict[int, float]:
    """Loss per step from metrics.jsonl; a step logged again after a resume counts last."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row["loss"] for row in rows}


def read_curve(path: Path) -> Curve:
    """The loss and gradient-norm curves of a metrics.jsonl file (a step logged again after
    a resume counts once, as logged last)."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    # A step logged again after a resume counts last.
    last = {r["step"]: r for r in rows}
    rows = [last[step] for step in sorted(last)]
    return Curve(
        loss=[r["loss"] for r in rows],
        grad_norm=[r["grad_norm"] for r in rows],
        val_loss=[r["val_loss"] for r in rows if "val_loss" in r],
    )


def assert_same_training(curve: Curve, expected: Curve) -> None:
    """The loss agrees step by step within FP32_TOLERANCE, the gradient norm within
    GRAD_NORM_TOLERANCE (and at the first step, where the weights are identical, within
    FP32_TOLERANCE too)."""
    assert max_relative_difference(curve.loss, expected.loss) <= FP32_TOLERANCE
    assert max_relative_difference(curve.grad_norm[:1], expected.grad_norm[:1]) <= FP32_TOLERANCE
    assert max_relative_difference(curve.grad_norm, expected.grad_norm) <= GRAD_NORM_TOLERANCE


def assert_same_curve(curve: Curve, expected: Curve) -> None:
    """`assert_same_training`, and the validation loss within FP32_TOLERANCE too."""
    assert_same_training(curve, expected)
    assert expected.val_loss, "the reference evaluated nothing"
    assert max_relative_difference(curve.val_loss, expected.val_loss) <= FP32_TOLERANCE


def max_relative_difference(a: list[float], b: list[float]) -> float:
    """Largest |a - b| / |b| over steps; the curves must have the same length."""
    assert len(a) == len(b), f"curves differ in length: {len(a)} vs {len(b)}"
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))
