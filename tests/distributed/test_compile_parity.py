"""Compile on gives the FP32 loss curve of compile off, alone and under TP x FSDP2 with
explicit prefetching, with no graph break and no recompile after the first step (dynamo's
counters, logged by the trainer); small DDP buckets change nothing; bf16 gradient reduction
stays close to it. (Compile with recompute is covered in tests/unit/test_compile.py, in one
process; the counters of the one-process paths in tests/unit/test_compile_counters.py.)

FP32 on CPU: inductor fuses and reorders elementwise work, so the per-step loss and gradient
norm must match the eager single-process reference within a relative 1e-5 (measured: about
1e-6). The inductor cache (TORCHINDUCTOR_CACHE_DIR, set by conftest) makes every compiled run
after the first reuse the same kernels.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.distributed.harness import FP32_TOLERANCE, max_relative_difference, run_pretrain

pytestmark = pytest.mark.distributed

# bf16 keeps 8 bits of mantissa: each reduced gradient is rounded by up to 2**-8 relative.
BF16_REDUCE_TOLERANCE = 1e-2


@pytest.fixture(scope="module")
def reference(workdir: Path):
    return run_pretrain(workdir / "eager", ["train.steps=5"], nproc=1)


@pytest.mark.parametrize(
    ("label", "overrides", "nproc"),
    [
        ("compile_dp1", ["compile.enabled=true"], 1),
        (
            "compile_tp2_zero3_prefetch2_dp2",
            [
                "compile.enabled=true",
                "parallel.tp=2",
                "parallel.zero=3",
                "parallel.fsdp_prefetch=2",
            ],
            4,
        ),
        ("ddp_small_buckets_dp2", ["parallel.zero=0", "parallel.ddp_bucket_mb=0.01"], 2),
    ],
)
def test_fp32_curve_matches_eager_reference(workdir, reference, label, overrides, nproc) -> None:
    curve = run_pretrain(workdir / label, ["train.steps=5", *overrides], nproc=nproc)
    assert max_relative_difference(curve.loss, reference.loss) <= FP32_TOLERANCE
    assert max_relative_difference(curve.grad_norm, reference.grad_norm) <= FP32_TOLERANCE
    if "compile.enabled=true" in overrides:
        rows = [json.loads(line) for line in (workdir / label / "metrics.jsonl").open()]
        graphs = [row["compile_graphs"] for row in rows]
        # Blocks and loss compile in step 1; the evaluation at step 4 adds its no-grad graph.
        assert graphs[0] > 0 and graphs[:3] == [graphs[0]] * 3
        assert [row["compile_graph_breaks"] for row in rows] == [0] * len(rows)
        assert [row["compile_recompiles"] for row in rows] == [0] * len(rows)
        assert rows[0]["compile_time_s"] > 0


def test_bf16_gradient_reduction_tracks_fp32_under_ddp(workdir, reference) -> None:
    overrides = ["train.steps=5", "parallel.zero=0", "precision.reduce_dtype=bf16"]
    curve = run_pretrain(workdir / "ddp_bf16_reduce", overrides, nproc=2)
    assert max_relative_difference(curve.loss, reference.loss) <= BF16_REDUCE_TOLERANCE
    # The rounding must actually happen: an fp32 reduction would match to 1e-5.
    assert max_relative_difference(curve.grad_norm, reference.grad_norm) > FP32_TOLERANCE
