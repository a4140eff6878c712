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

import pytest

from tests.helpers import made_once

FP32_TOLERANCE = 1e-5
"""Relative per-step difference an FP32 layout may show against the one-process run in the
loss and the validation loss, and in the gradient norm at step 1 (where every layout starts
from the same weights): what reordered FP32 sums leave (measured differences are around
1e-7).

After step 1 the gradient norm, a sum of squares over every parameter, amplifies the
reordering once the weights have moved apart by rounding, and by how much depends on the
machine's kernels: on one 2-core CPU tensor parallelism drifts by 6.5e-5 by step 8 while its
losses agree within 2e-7, on another by 1.2e-4. So its bound is not fixed but derived in each
test session from the reference itself (`grad_norm_tolerance`): the one-process run is
trained a second time with its sums reordered (REORDERED), and a layout may drift
GRAD_NORM_SPREAD_MULTIPLE times (GRAD_NORM_SPREAD_FLOOR plus) the largest spread between the
two."""
REORDERED = ("train.micro_batch=1",)
"""The one-process reference again with its sums in another order: the same data, seed and
global batch, accumulated over 8 micro-batches of 1 instead of 4 of 2. That is the kind of
reordering a parallel layout brings (other partial sums, summed in another order), and it
trains the same model: its loss and validation loss agree with the reference's within
FP32_TOLERANCE (checked where the bound is derived, `grad_norm_tolerance`)."""
GRAD_NORM_SPREAD_FLOOR = 1e-6
"""Added to the measured spread, so that a machine whose reordered run happens to agree
almost exactly still leaves a layout the rounding of its own sums."""
GRAD_NORM_SPREAD_MULTIPLE = 10
"""How far beyond the reference's own spread a layout's gradient norm may drift after step 1.
Measured on a 2-core CPU (torch 2.13, 8 steps of the harness model): the reordered
reference spreads by up to 2.1e-5 (at step 8), tensor parallelism (tp2, tp2 x sp) by up to
6.5e-5, about 3 times as much, so the bound there is 10 x (1e-6 + 2.1e-5) = 2.2e-4; 10
leaves room for a layout that reorders more than micro-batching does and for the step that
happens to amplify the most. A gradient summed wrongly moves the norm by far more (the MLA
rotary key gradient left unsummed over tp moved it by 1.4%)."""

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

MLA = ("model.attention=mla", "model.n_kv_heads=0", "model.mla_q_rank=32")
"""The harness model with multi-head latent attention, its queries through a latent too."""


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
        "pretrain",
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


def logged_rows(run_dir: Path, prefixes: tuple[str, ...]) -> dict[int, dict[str, float]]:
    """{step: {metric: value}} of the metrics whose names start with one of `prefixes`, at
    the steps that logged any (a step logged again after a resume counts last)."""
    rows: dict[int, dict[str, float]] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        picked = {k: v for k, v in row.items() if k.startswith(prefixes)}
        if picked:
            rows[row["step"]] = picked
    return rows


def grad_norm_tolerance(reference: Curve, reordered: Curve) -> float:
    """The bound on a layout's gradient norm after step 1, derived from the reference and the
    reference trained again with REORDERED sums: GRAD_NORM_SPREAD_MULTIPLE x
    (GRAD_NORM_SPREAD_FLOOR + the largest relative spread of their gradient norms over steps
    2..). The reordered run must train the same model (loss and validation loss within
    FP32_TOLERANCE), or its spread would measure something else than rounding."""
    assert max_relative_difference(reordered.loss, reference.loss) <= FP32_TOLERANCE
    assert max_relative_difference(reordered.val_loss, reference.val_loss) <= FP32_TOLERANCE
    spread = max_relative_difference(reordered.grad_norm[1:], reference.grad_norm[1:])
    return GRAD_NORM_SPREAD_MULTIPLE * (GRAD_NORM_SPREAD_FLOOR + spread)


def assert_same_training(curve: Curve, expected: Curve, grad_norm_tolerance: float) -> None:
    """The loss agrees step by step within FP32_TOLERANCE, the gradient norm within
    FP32_TOLERANCE at the first step (identical weights) and within `grad_norm_tolerance`
    (the session's derived bound, the `grad_norm_tolerance` fixture) after it."""
    assert max_relative_difference(curve.loss, expected.loss) <= FP32_TOLERANCE
    assert max_relative_difference(curve.grad_norm[:1], expected.grad_norm[:1]) <= FP32_TOLERANCE
    assert max_relative_difference(curve.grad_norm, expected.grad_norm) <= grad_norm_tolerance


def assert_same_curve(curve: Curve, expected: Curve, grad_norm_tolerance: float) -> None:
    """`assert_same_training`, and the validation loss within FP32_TOLERANCE too."""
    assert_same_training(curve, expected, grad_norm_tolerance)
    assert expected.val_loss, "the reference evaluated nothing"
    assert max_relative_difference(curve.val_loss, expected.val_loss) <= FP32_TOLERANCE


STEP_REGIONS = ("forward", "backward", "optimizer", "blocked")
"""The step breakdown every CPU run logs (`time_<region>_s`, trainer/step/phases.py)."""
PIPELINE_REGIONS = (*STEP_REGIONS, "bubble")
"""A pipelined run's: also the bubble, and every region per pipeline rank."""


def step_breakdown_keys(pp: int) -> set[str]:
    """Every `time_*` key a CPU run with `pp` pipeline ranks logs at each logged step (W&B
    `time/*`, with `data_wait_s`)."""
    if pp == 1:
        return {f"time_{region}_s" for region in STEP_REGIONS}
    per_stage = {f"time_stage{r}_{region}_s" for r in range(pp) for region in PIPELINE_REGIONS}
    return {f"time_{region}_s" for region in PIPELINE_REGIONS} | per_stage


def assert_step_breakdown(run_dir: Path, pp: int) -> None:
    """Every logged step of the run holds the whole step breakdown, the data wait and, in a
    pipeline, a bubble on every pipeline rank (each waits for the other's first activation
    or last gradient)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows
    for row in rows:
        # The stability monitors' share (time_stability_s) shows at the steps they sample.
        timed = {key for key in row if key.startswith("time_") and "_stability_" not in key}
        assert timed == step_breakdown_keys(pp)
        assert row["data_wait_s"] >= 0
        assert row["time_forward_s"] > 0 and row["time_backward_s"] > 0
        assert all(row[f"time_stage{r}_bubble_s"] > 0 for r in range(pp) if pp > 1)


PARITY_LOG_ENV = "PRETRAIN_PARITY_LOG"
"""A file each comparison of curves is appended to as a JSON line (test id, the largest
relative difference, the steps compared), when set: the worst difference per layout of a
suite run, read off after it."""


def max_relative_difference(a: list[float], b: list[float]) -> float:
    """Largest |a - b| / |b| over steps; the curves must have the same length."""
    assert len(a) == len(b), f"curves differ in length: {len(a)} vs {len(b)}"
    worst = max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))
    log = os.environ.get(PARITY_LOG_ENV)
    if log:
        test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0]
        line = json.dumps({"test": test, "difference": worst, "steps": len(a)}) + "\n"
        with open(log, "a", encoding="utf-8") as f:  # one short write: whole lines
            f.write(line)
    return worst


def trained_once(
    factory: pytest.TempPathFactory, name: str, overrides: list[str], recipe: str = "tiny"
) -> Path:
    """The run dir of a one-process run of the harness model (`overrides` on `recipe`),
    trained once per test session and shared by every worker: tests only read it."""
    folder = made_once(
        factory, name, lambda path: run_pretrain(path / "run", overrides, nproc=1, recipe=recipe)
    )
    return folder / "run"


def _write_run_dir(run_dir: Path, overrides: list[str], recipe: str, base: tuple[str, ...]) -> Path:
    """The run dir the launcher writes for `overrides` on `recipe` (as `action=script`:
    composition, validation, plan, config.yaml), without launching; its config's path."""
    from pretrain.launcher.cli import execute
    from tests.helpers import compose_recipe

    given = [*base, *overrides, "action=script", f"run.dir={run_dir}"]
    execute(compose_recipe(recipe, given), {"recipe": recipe, "overrides": given})
    return run_dir / "config.yaml"


RANK_RUNS_PER_LAUNCH = 48
"""Runs times ranks one launch trains at most (12 runs of 4 ranks). Every run's mesh adds
process groups that a launch keeps to its end (tests/distributed/one_launch.py says why),
each with gloo threads of its own: the pairwise matrix's 66 runs of 4 ranks in one launch
left about 3,700 of them and a load average near 400 on 2 cores, slowing every test beside
it (the suite took 37 minutes); in launches of 12 the matrix alone takes 6m15s, load under 8."""


def _launch_together(folder: Path, nproc: int, configs: list[Path]) -> dict[Path, str]:
    """Train `configs` one after another in launches of `nproc` ranks
    (tests.distributed.one_launch.py) of at most RANK_RUNS_PER_LAUNCH / `nproc` runs each,
    and after a run that fails another from the run after it. What stopped each failed run, by its
    config."""
    failures: dict[Path, str] = {}
    per_launch = max(1, RANK_RUNS_PER_LAUNCH // nproc)
    launches = 0
    while configs:
        listing = folder / f"together{nproc}-{launches}.txt"
        launches += 1
        listing.write_text("\n".join(map(str, configs[:per_launch])))
        module = "tests.distributed.one_launch"
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        result = subprocess.run(
            [sys.executable, "-m", module, str(nproc), str(listing)],
            capture_output=True, text=True, timeout=1800, env=env,
            cwd=Path(__file__).resolve().parents[2],
        )  # fmt: skip
        listing.with_suffix(".log").write_text(result.stdout + result.stderr)
        if result.returncode == 0:
            configs = configs[per_launch:]
            continue
        failed = listing.with_suffix(".failed")
        if not failed.exists():
            for config in configs[:per_launch]:
                failures[config] = f"the launch of {nproc} ranks failed: {result.stderr[-3000:]}"
            configs = configs[per_launch:]
            continue
        config, trace = failed.read_text().split("\n", 1)
        failures[Path(config)] = trace[-4000:]
        configs = configs[configs.index(Path(config)) + 1 :]
    return failures


@dataclass(frozen=True)
class Layout:
    """One run of `train_together`: its overrides (on the recipe and base) and ranks."""

    overrides: tuple[str, ...]
    nproc: int
    recipe: str = "tiny"


class TrainedTogether:
    """Runs trained by `train_together`: each one's curve, or its failure."""

    def __init__(self, dirs: dict[str, Path], failures: dict[Path, str]) -> None:
        self.dirs = dirs
        self.failures = failures

    def curve(self, label: str) -> Curve:
        """The run's curve; a run that failed fails the test with its traceback."""
        run_dir = self.dirs[label]
        if run_dir / "config.yaml" in self.failures:
            pytest.fail(f"{label} failed:\n{self.failures[run_dir / 'config.yaml']}")
        return read_curve(run_dir / "metrics.jsonl")


def train_together(
    folder: Path, layouts: dict[str, Layout], base: tuple[str, ...] = BASE_OVERRIDES
) -> TrainedTogether:
    """Train every layout (by label, each in FOLDER/label) as `run_pretrain` would, but the
    layouts of one world size one after another in a single launch: the launcher writes each
    run dir, the trainer's own `run` trains it. A launch costs several seconds of start on a
    small machine; a module's layouts share them."""
    configs: dict[int, list[Path]] = {}
    dirs = {}
    for label, layout in layouts.items():
        dirs[label] = folder / label
        overrides = [*layout.overrides, f"cluster.gpus_per_node={layout.nproc}"]
        config = _write_run_dir(dirs[label], overrides, layout.recipe, base)
        configs.setdefault(layout.nproc, []).append(config)
    failures: dict[Path, str] = {}
    for nproc, listed in sorted(configs.items()):
        failures.update(_launch_together(folder, nproc, listed))
    return TrainedTogether(dirs, failures)
