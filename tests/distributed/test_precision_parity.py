"""FP8 (torchao, emulated on CPU) and FP16 with dynamic loss scaling, through the real CLI.

FP8 E4M3 keeps 3 mantissa bits, so each FP8 matmul input is rounded by up to 2**-4 relative
and the FP8 curve drifts from the BF16 one as training goes on. At this learning rate both
curves have single-step spikes at different steps (measured: FP8 6.08 against BF16 5.39 at
step 20, recovered the next step), so the curves are compared by their means over windows of
10 steps: measured within 1.2% over 50 steps, against a stated bound of 5%. And FP8 must
learn: its loss falls by at least 90% of what BF16's falls (measured 104%). A constant
schedule makes a short run a prefix of a longer one, so the ZeRO-3 run can be compared with
the first steps.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.distributed.harness import max_relative_difference, run_pretrain

pytestmark = pytest.mark.distributed

FP8_VS_BF16 = 0.05
FP8_LEARNS = 0.90
SAME_PRECISION = 1e-3
"""Relative per-step bound between layouts of one precision (as BF16 in the DP parity tests)."""
FP8_SAME_PRECISION = 2e-3
"""The same bound for FP8 under ZeRO-3. FSDP2 hands the blocks weights already cast to bf16,
where the one-process run casts FP32 weights under autocast; BF16 alone moves the loss by
3.4e-4 over these 10 steps for that reason, and FP8's 3-bit mantissa turns such differences
into rounding flips: measured 1.2e-3 with FP8 all-gather and 8.5e-4 without it, while FP8
under DDP (same casts as one process) stays within 1e-7."""
FP8 = ["precision.dtype=fp8", "precision.fp8_emulate=true", "schedule=constant"]
# float16's largest value is 65504; one logit's gradient alone is about scale / 128 tokens
# per micro-batch, so a scale of 2**40 must overflow on step 1. Backing off by 2**-8 per
# overflow brings the scale down to where steps go through within a few steps.
FP16_OVERFLOW = [
    "precision.dtype=fp16",
    f"precision.loss_scale_init={2.0**40}",
    f"precision.loss_scale_backoff={2.0**-8}",
    "precision.loss_scale_interval=3",
    "schedule=constant",
    "train.steps=10",
]


def window_means(losses: list[float], window: int = 10) -> list[float]:
    """The mean loss of each `window` consecutive steps."""
    return [sum(losses[i : i + window]) / window for i in range(0, len(losses), window)]


def records(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


@pytest.fixture(scope="module")
def fp8_curve(workdir: Path):
    return run_pretrain(workdir / "fp8", [*FP8, "train.steps=50"], nproc=1)


def test_fp8_emulated_tracks_bf16_over_50_steps(workdir, fp8_curve) -> None:
    bf16 = run_pretrain(
        workdir / "bf16", ["precision=bf16", "schedule=constant", "train.steps=50"], nproc=1
    )
    assert len(fp8_curve.loss) == 50
    assert max_relative_difference(window_means(fp8_curve.loss), window_means(bf16.loss)) <= (
        FP8_VS_BF16
    )
    fall_fp8 = fp8_curve.loss[0] - fp8_curve.loss[-1]
    fall_bf16 = bf16.loss[0] - bf16.loss[-1]
    assert fall_bf16 > 0.5 and fall_fp8 >= FP8_LEARNS * fall_bf16
    last = records(workdir / "fp8")[-1]
    # Emulated FP8 matmuls run in high precision: MFU is measured against that peak.
    assert last["peak_dtype"] == "fp32" and last["peak_source"].startswith("CPU peak measured")


def test_fp8_under_zero3_with_fp8_all_gather_matches_one_rank(workdir, fp8_curve) -> None:
    overrides = [*FP8, "train.steps=10", "parallel.zero=3", "precision.fp8_all_gather=true"]
    curve = run_pretrain(workdir / "fp8_zero3", overrides, nproc=2)
    assert max_relative_difference(curve.loss, fp8_curve.loss[:10]) <= FP8_SAME_PRECISION


def test_fp16_overflow_skips_the_same_steps_on_one_rank_and_under_zero3(workdir) -> None:
    run_pretrain(workdir / "fp16_dp1", FP16_OVERFLOW, nproc=1)
    run_pretrain(workdir / "fp16_zero3", [*FP16_OVERFLOW, "parallel.zero=3"], nproc=2)
    one, sharded = records(workdir / "fp16_dp1"), records(workdir / "fp16_zero3")

    assert one[0]["skipped_steps"] == 1 and one[0]["grad_norm"] is None
    assert one[-1]["skipped_steps"] < len(one), "the scale never came down to a usable value"
    # Each step either overflowed (no norm, the scale backs off) or went through (the scale
    # stays, or grows after 3 clean steps in a row).
    skipped, scale, factors = 0, 2.0**40, []
    for record in one:
        overflowed = record["skipped_steps"] > skipped
        assert (record["grad_norm"] is None) == overflowed
        factors.append(record["loss_scale"] / scale)
        assert factors[-1] in ((2.0**-8,) if overflowed else (1.0, 2.0))
        skipped, scale = record["skipped_steps"], record["loss_scale"]
    assert 2.0 in factors, "the scale never grew back"
    assert one[-1]["loss"] < one[0]["loss"]

    # The overflow test is the all-reduced global norm: the sharded ranks skip together, and
    # as the one process does through the initial back-off and the regrowth after it. Once
    # the regrown scale brings the largest gradient to float16's limit, which step overflows
    # is decided by the gradients' last bits, which FSDP's fp16 weights and one process's
    # autocast round differently (measured: the sharded run overflowed at step 10 with the
    # scale at 2**18, the one process did not): the runs are compared up to that step.
    backoff = next(i for i, r in enumerate(one) if r["grad_norm"] is not None)
    late = [
        i
        for i in range(backoff, len(one))
        if max(one[i]["skipped_steps"], sharded[i]["skipped_steps"]) > backoff
    ]
    agree = late[0] if late else len(one)
    assert agree >= 8, "the runs parted before the scale had regrown"
    assert [r["skipped_steps"] for r in sharded[:agree]] == [
        r["skipped_steps"] for r in one[:agree]
    ]
    assert [r["loss_scale"] for r in sharded[:agree]] == [r["loss_scale"] for r in one[:agree]]
    loss_one, loss_sharded = [r["loss"] for r in one], [r["loss"] for r in sharded]
    assert max_relative_difference(loss_sharded[:agree], loss_one[:agree]) <= SAME_PRECISION
