"""`faults.on_nan` and `faults.on_spike` under each action (skip, rollback, halt), on 2 ranks.

Faults are injected on batches (PRETRAIN_FAULT_NAN_STEPS, PRETRAIN_FAULT_SPIKE_STEPS: the
batch of that step in the run's data order), so a batch a rollback skipped is never bad
again. Each expected loss is built by hand in this process: the logged loss of a step is the
loss of the weights before it on its batch, so after a skipped step it is the loss of the
checkpoint before the skip on the next batch, and after a rollback the loss of the restored
checkpoint on the batch after the bad one.

Three launches cover the six cases: run A skips a NaN and rolls back a spike; run C rolls
back a NaN (lowering the rate for a step) and halts on a spike; run B resumes C's run dir
from the rollback's checkpoint under other policies, so it must skip C's batch again and
repeat C's steps exactly, then skips the spike and halts on a NaN. (B needs C's run dir:
both are one test.)
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from pretrain.trainer.checkpoint.export import load_model
from pretrain.trainer.data.loader import one_process_loader
from pretrain.trainer.step.state import lm_loss
from tests.distributed.harness import FP32_TOLERANCE, launch

pytestmark = pytest.mark.distributed

POLICY_BASE = [
    "parallel.zero=0",
    "checkpoint.every=2",
    "checkpoint.keep=4",
    "faults.spike_window=2",
    "faults.spike_factor=3",
]


def rows(run_dir: Path) -> list[dict]:
    """metrics.jsonl in the order written (a step trained again appears twice)."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def audit(run_dir: Path) -> list[tuple[int, str, str]]:
    """(step, trigger, action) of every audited action."""
    lines = (run_dir / "faults.jsonl").read_text().splitlines()
    return [(r["step"], r["trigger"], r["action"]) for r in map(json.loads, lines)]


def checkpoints(run_dir: Path) -> list[int]:
    return sorted(int(p.name.split("_")[1]) for p in (run_dir / "checkpoints").iterdir())


def loss_on_batch(run_dir: Path, weights_of: int, batch_of: int) -> float:
    """The loss the weights of checkpoint `weights_of` have on the batch of step `batch_of`
    (in the data order), computed by one process."""
    model, cfg, _ = load_model(run_dir, step=weights_of)
    micro_batches = one_process_loader(cfg).batches(batch_of - 1)
    with torch.no_grad():
        losses = [lm_loss(model(x), y).item() for x, y in micro_batches]
    return sum(losses) / len(losses)


def failure_line(stderr: str) -> str:
    """The launcher's one-line summary of the rank failure that ended the run."""
    return next(x for x in stderr.splitlines() if x.startswith("training failed on rank "))


def assert_close(actual: float, expected: float) -> None:
    assert abs(actual - expected) / abs(expected) <= FP32_TOLERANCE, (actual, expected)


def test_a_nan_is_skipped_and_a_spike_rolls_back_past_its_batch(workdir: Path) -> None:
    run_dir = workdir / "skip_nan_rollback_spike"
    env = {"PRETRAIN_FAULT_NAN_STEPS": "3", "PRETRAIN_FAULT_SPIKE_STEPS": "6"}
    result = launch(run_dir, [*POLICY_BASE, "faults.on_spike=rollback"], 2, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    logged = rows(run_dir)
    assert [r["step"] for r in logged] == [1, 2, 3, 4, 5, 6, 5, 6, 7, 8]
    # Skip: step 3 applied no update, so step 4 starts from the weights of step 2.
    assert logged[2]["loss"] is None and logged[2]["grad_norm"] is None
    assert [r["skipped_steps"] for r in logged] == [0, 0, 1, 1, 1, 1, 1, 1, 1, 1]
    assert_close(logged[3]["loss"], loss_on_batch(run_dir, 2, 4))
    # Rollback: step 6's spike (rank 0's loss 20 times larger) reloads step 4; the batches
    # of steps 5 and 6 are skipped, so step 5 trains again on the batch of step 7.
    assert logged[5]["loss"] > 3 * (logged[3]["loss"] + logged[4]["loss"]) / 2
    assert_close(logged[6]["loss"], loss_on_batch(run_dir, 4, 7))
    assert logged[6]["lr"] == logged[4]["lr"]  # the rate was not lowered (factor 1)
    assert audit(run_dir) == [(3, "nan", "skip"), (6, "spike", "rollback")]
    rollback = json.loads((run_dir / "faults.jsonl").read_text().splitlines()[1])
    assert rollback["to"] == 4 and rollback["skipped_batches"] == [5, 6]
    assert "[faults] step 6: loss " in result.stdout and "batches 5..6 skipped" in result.stdout
    assert checkpoints(run_dir) == [2, 4, 6, 8]


def test_a_stability_alert_rolls_back_past_its_batch(workdir: Path) -> None:
    """faults.on_alert=rollback: the spike of step 5 (rank 0's loss and gradients 20 times
    larger) lifts the per-layer gradient norm above its threshold of 3 (about 0.7 on the
    other steps); the loss rule is off, so the alert alone reloads step 4."""
    run_dir = workdir / "rollback_alert"
    alert = ["faults.on_alert=rollback", "logging.stability_every=1"]
    alert += ["logging.stability_alerts.grad_norm_max=3", "train.steps=6"]
    env = {"PRETRAIN_FAULT_SPIKE_STEPS": "5"}
    result = launch(run_dir, [*POLICY_BASE, *alert], 2, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    logged = rows(run_dir)
    assert [r["step"] for r in logged] == [1, 2, 3, 4, 5, 5, 6]
    assert max(r["stability/grad_norm_max"] for r in logged if r is not logged[4]) < 3
    assert logged[4]["stability/grad_norm_max"] > 3
    assert_close(logged[5]["loss"], loss_on_batch(run_dir, 4, 6))
    assert audit(run_dir) == [(5, "alert", "rollback")]
    rollback = json.loads((run_dir / "faults.jsonl").read_text())
    assert rollback["to"] == 4 and rollback["skipped_batches"] == [5, 5]
    assert "stability/grad_norm_max = " in rollback["detail"]
    assert "[faults] step 5: stability/grad_norm_max" in result.stdout


def test_a_rolled_back_nan_lowers_the_rate_a_spike_halts_and_a_resume_skips_the_same_batches(
    workdir: Path,
) -> None:
    """Run C, then run B: C's run dir resumed from step 2 (the rollback's target; C's step 4
    removed) under on_spike=skip and on_nan=halt."""
    run_c = workdir / "rollback_nan_halt_spike"
    lowered = ["faults.rollback_lr_factor=0.5", "faults.rollback_lr_steps=1"]
    overrides = [*POLICY_BASE, *lowered, "faults.on_nan=rollback", "faults.on_spike=halt"]
    env = {"PRETRAIN_FAULT_NAN_STEPS": "3", "PRETRAIN_FAULT_SPIKE_STEPS": "6"}
    result = launch(run_c, overrides, 2, env=env)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    logged_c = rows(run_c)
    # The NaN of step 3 reloads step 2 and skips its batch: steps 3, 4, 5 train the batches
    # of steps 4, 5, 6, at half the rate for step 3; batch 6 is the spike, at step 5, which
    # halts the run before it is logged or saved.
    assert [r["step"] for r in logged_c] == [1, 2, 3, 3, 4]
    assert_close(logged_c[3]["loss"], loss_on_batch(run_c, 2, 4))
    assert logged_c[3]["lr"] == pytest.approx(0.5 * logged_c[2]["lr"], rel=1e-12)
    assert logged_c[4]["lr"] > logged_c[3]["lr"]
    failed = failure_line(result.stderr)
    assert "step 5: loss " in failed and "(faults.on_spike=halt)" in failed
    assert audit(run_c) == [(3, "nan", "rollback"), (5, "spike", "halt")]
    assert checkpoints(run_c) == [2, 4]

    run_b = workdir / "resumed_skip_spike_halt_nan"
    shutil.copytree(run_c, run_b)
    shutil.rmtree(run_b / "checkpoints" / "step_00000004")
    overrides = [*POLICY_BASE, *lowered, "faults.on_nan=halt", "faults.on_spike=skip"]
    env = {"PRETRAIN_FAULT_NAN_STEPS": "3,9", "PRETRAIN_FAULT_SPIKE_STEPS": "6"}
    result = launch(run_b, overrides, 2, env=env)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert (
        "data resumes after batch 3 of the data order, as the rollback to step 2" in result.stdout
    )
    logged = rows(run_b)[len(logged_c) :]
    assert [r["step"] for r in logged] == [3, 4, 5, 6, 7]
    # The same batches, the same lowered rate: C's steps 3 and 4 exactly.
    assert [(r["loss"], r["lr"]) for r in logged[:2]] == [
        (r["loss"], r["lr"]) for r in logged_c[3:5]
    ]
    # The spike on batch 6 (step 5) is skipped: step 6 starts from the weights of step 4.
    assert_close(logged[3]["loss"], loss_on_batch(run_b, 4, 7))
    failed = failure_line(result.stderr)
    assert "step 8: non-finite loss or gradient norm (faults.on_nan=halt)" in failed
    assert audit(run_b)[2:] == [(5, "spike", "skip"), (8, "nan", "halt")]
    assert checkpoints(run_b) == [2, 4, 6]
