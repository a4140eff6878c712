"""Every data-parallel layout and recompute policy reproduces the single-process loss curve.

FP32 on CPU: the per-step loss and gradient norm, and the validation loss at steps 4 and 8,
must match the one-process reference within a relative 1e-5 (what reordered FP32 sums
leave); BF16 within 1e-3 of the BF16 reference (FSDP's mixed-precision policy casts the
weights, autocast the matmuls, so they round differently).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.harness import (
    Layout,
    TrainedTogether,
    assert_same_curve,
    max_relative_difference,
    run_pretrain,
    train_together,
)

pytestmark = pytest.mark.distributed

BF16_TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def reference(harness_reference):
    return harness_reference


def test_reference_loss_falls(reference) -> None:
    assert reference.loss[-1] < reference.loss[0] - 0.3


LAYOUTS = {
    "ddp_dp2": Layout(("parallel.zero=0",), 2),
    "zero1_dp2": Layout(("parallel.zero=1",), 2),
    "zero2_dp2": Layout(("parallel.zero=2",), 2),
    "zero3_dp2": Layout(("parallel.zero=3",), 2),
    "hsdp_dp4": Layout(("parallel.zero=3", "parallel.dp_replicate=2"), 4),
    "hybrid_zero1_dp4": Layout(("parallel.zero=1", "parallel.dp_replicate=2"), 4),
    "full_recompute_zero3_dp2": Layout(("parallel.zero=3", "recompute=full"), 2),
    "selective_recompute_dp1": Layout(("recompute=selective",), 1),
    "full_recompute_every2_dp2": Layout(("recompute=full", "recompute.every=2"), 2),
}
"""Each FP32 layout, by label."""


@pytest.fixture(scope="module")
def trained(workdir: Path) -> TrainedTogether:
    """The layouts, those of one world size in one launch."""
    return train_together(workdir, LAYOUTS)


@pytest.mark.parametrize("label", LAYOUTS)
def test_fp32_layout_matches_reference(trained, reference, grad_norm_tolerance, label) -> None:
    assert_same_curve(trained.curve(label), reference, grad_norm_tolerance)


def test_bf16_zero2_tracks_bf16_reference(workdir) -> None:
    reference = run_pretrain(workdir / "bf16_reference", ["precision=bf16"], nproc=1)
    curve = run_pretrain(workdir / "bf16_zero2", ["precision=bf16", "parallel.zero=2"], nproc=2)
    assert max_relative_difference(curve.loss, reference.loss) <= BF16_TOLERANCE
