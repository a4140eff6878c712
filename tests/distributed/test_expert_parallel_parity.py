"""Expert parallelism reproduces the single-process MoE run, dropless and with a capacity.

FP32 on CPU, relative 1e-5 per step on the loss and the gradient norm, as for data
parallelism. The model is the harness's with the tiny_moe recipe's experts (8 routed of
width 64, top-2, one shared, first layer dense). With a capacity factor of 1 the early,
unbalanced router drops assignments; the drop decision is taken per sequence, so every
layout must drop the same share, which the expert-load metrics report.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.distributed.harness import (
    assert_same_curve,
    read_curve,
    run_pretrain,
)

pytestmark = pytest.mark.distributed

MOE = ["model.moe_ffn_dim=64"]
CAPACITY = ["model.moe_capacity_factor=1.0"]


def dropped_fractions(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [row["moe_dropped_frac"] for row in rows]


@pytest.fixture(scope="module")
def reference_runs(workdir: Path, moe_reference_run: Path) -> dict[str, Path]:
    """The one-process run dirs: the session's dropless reference and one with a capacity."""
    run_pretrain(workdir / "capacity", MOE + CAPACITY, nproc=1, recipe="tiny_moe")
    return {"dropless": moe_reference_run, "capacity": workdir / "capacity"}


@pytest.fixture(scope="module")
def references(reference_runs: dict[str, Path]) -> dict:
    return {name: read_curve(path / "metrics.jsonl") for name, path in reference_runs.items()}


def test_references_train_and_only_the_capacity_run_drops(reference_runs, references) -> None:
    for curve in references.values():
        assert curve.loss[-1] < curve.loss[0] - 0.1
    assert max(dropped_fractions(reference_runs["dropless"])) == 0.0
    assert min(dropped_fractions(reference_runs["capacity"])) > 0.0


@pytest.mark.parametrize(
    ("label", "routing", "overrides", "nproc"),
    [
        ("ep2_dp2", "dropless", ["parallel.ep=2"], 2),
        ("ep2_dp2_capacity", "capacity", ["parallel.ep=2"], 2),
        ("ep4_dp4", "dropless", ["parallel.ep=4"], 4),
        ("ep2_dp4_zero3_capacity", "capacity", ["parallel.ep=2", "parallel.zero=3"], 4),
        (
            "ep2_tp2_sp_zero2",
            "dropless",
            ["parallel.ep=2", "parallel.tp=2", "parallel.sp=true", "parallel.zero=2"],
            4,
        ),
    ],
)
def test_expert_parallel_layout_matches_reference(
    workdir, reference_runs, references, label, routing, overrides, nproc
) -> None:
    routing_overrides = MOE + (CAPACITY if routing == "capacity" else [])
    curve = run_pretrain(
        workdir / label, routing_overrides + overrides, nproc=nproc, recipe="tiny_moe"
    )
    expected = references[routing]
    assert_same_curve(curve, expected)
    assert dropped_fractions(workdir / label) == pytest.approx(
        dropped_fractions(reference_runs[routing]), rel=1e-12
    )
