"""Expert parallelism reproduces the single-process MoE run, dropless and with a capacity.

FP32 on CPU, relative 1e-5 per step on the loss and the gradient norm, as for data
parallelism. The model is the harness's with the tiny_moe recipe's experts (8 routed of
width 64, top-2, one shared, first layer dense). With a capacity factor of 1 the early,
unbalanced router drops assignments; the drop decision is taken per sequence, so every
layout must drop the same share, which the expert-load metrics report.

Under context parallelism each cp rank routes its own chunks, with the capacity queues and
the balance loss's fractions of the whole sequence (the chunks' counts gathered over cp), the
biases following the loads of dp x cp, and the experts' replicas spanning cp: cp2 alone with
the balancing bias, and cp2 x ep2 x dp2 with a capacity, which drops the same share.

Experts sharded by ZeRO-3 over the ranks that hold the same experts as well as by ep, with
the aux-loss-free balancing bias: the run is interrupted while saving step 6, matches the
single process up to there, and resumes from step 4 under another ep and ZeRO stage,
balancing bias included (its value at step 8 equals the single process's).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pretrain.trainer.checkpoint.export import load_model
from tests.distributed.harness import (
    FP32_TOLERANCE,
    Layout,
    TrainedTogether,
    assert_same_curve,
    launch,
    logged_losses,
    read_curve,
    train_together,
)

pytestmark = pytest.mark.distributed

MOE = ["model.moe_ffn_dim=64"]
CAPACITY = ["model.moe_capacity_factor=1.0"]
BIAS = ["model.moe_balance=bias", "model.moe_bias_rate=0.002"]
CHECKPOINTS = ["checkpoint.every=2", "checkpoint.keep=3"]
ROUTING = {"dropless": [], "capacity": CAPACITY, "bias": BIAS}


def dropped_fractions(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [row["moe_dropped_frac"] for row in rows]


LAYOUTS = {
    "ep2_dp2": ("dropless", ["parallel.ep=2"], 2),
    "ep2_dp2_capacity": ("capacity", ["parallel.ep=2"], 2),
    "ep4_dp4": ("dropless", ["parallel.ep=4"], 4),
    "ep2_dp4_zero3_capacity": ("capacity", ["parallel.ep=2", "parallel.zero=3"], 4),
    "ep2_tp2_sp_zero2": (
        "dropless",
        ["parallel.ep=2", "parallel.tp=2", "parallel.sp=true", "parallel.zero=2"],
        4,
    ),
    "cp2_bias": ("bias", ["parallel.cp=2"], 2),
    "cp2_ep2_dp2_capacity": ("capacity", ["parallel.cp=2", "parallel.ep=2"], 4),
}
"""Each layout's routing (its reference), overrides and ranks."""


@pytest.fixture(scope="module")
def trained(workdir: Path) -> TrainedTogether:
    """The one-process runs with a capacity and with the expert bias, and the layouts; the
    runs of one world size in one launch."""
    layouts = {
        name: Layout((*MOE, *ROUTING[name]), 1, recipe="tiny_moe") for name in ("capacity", "bias")
    }
    for label, (routing, overrides, nproc) in LAYOUTS.items():
        layouts[label] = Layout((*MOE, *ROUTING[routing], *overrides), nproc, recipe="tiny_moe")
    return train_together(workdir, layouts)


@pytest.fixture(scope="module")
def reference_runs(trained: TrainedTogether, moe_reference_run: Path) -> dict[str, Path]:
    """The one-process run dirs: the session's dropless reference, one with a capacity and
    one balanced by the expert bias."""
    return {"dropless": moe_reference_run, **{n: trained.dirs[n] for n in ("capacity", "bias")}}


@pytest.fixture(scope="module")
def references(reference_runs: dict[str, Path]) -> dict:
    return {name: read_curve(path / "metrics.jsonl") for name, path in reference_runs.items()}


def test_references_train_and_only_the_capacity_run_drops(reference_runs, references) -> None:
    for curve in references.values():
        assert curve.loss[-1] < curve.loss[0] - 0.1
    assert max(dropped_fractions(reference_runs["dropless"])) == 0.0
    assert min(dropped_fractions(reference_runs["capacity"])) > 0.0


@pytest.mark.parametrize("label", LAYOUTS)
def test_expert_parallel_layout_matches_reference(
    trained, reference_runs, references, grad_norm_tolerance, label
) -> None:
    routing = LAYOUTS[label][0]
    assert_same_curve(trained.curve(label), references[routing], grad_norm_tolerance)
    assert dropped_fractions(trained.dirs[label]) == pytest.approx(
        dropped_fractions(reference_runs[routing]), rel=1e-12
    )


def relative_differences(ours: dict[int, float], reference: list[float]) -> float:
    return max(abs(ours[step] - reference[step - 1]) / abs(reference[step - 1]) for step in ours)


@pytest.mark.slow
def test_experts_sharded_by_zero_and_ep_match_and_resume_under_another_ep_and_zero(
    workdir, references
) -> None:
    run_dir = workdir / "ep2_zero3_bias"
    saved_under = [*MOE, *BIAS, *CHECKPOINTS, "parallel.ep=2", "parallel.zero=3"]
    crash = {"PRETRAIN_FAULT_CRASH_IN_SAVE": "6"}
    assert launch(run_dir, saved_under, 4, recipe="tiny_moe", env=crash).returncode != 0
    expected = references["bias"].loss
    before = logged_losses(run_dir)
    assert sorted(before) == [1, 2, 3, 4, 5]
    assert relative_differences(before, expected) <= FP32_TOLERANCE

    resumed_under = [*MOE, *BIAS, *CHECKPOINTS, "parallel.ep=4", "parallel.zero=2"]
    result = launch(run_dir, resumed_under, 4, recipe="tiny_moe")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from the checkpoint of step 4" in result.stdout
    after = logged_losses(run_dir)
    assert sorted(after) == list(range(1, 9))
    assert relative_differences(after, expected) <= FP32_TOLERANCE
    ours, _, _ = load_model(run_dir, step=8)
    reference, _, _ = load_model(workdir / "bias", step=8)
    for key, block in reference.layers.items():
        bias = block.feed_forward.state_dict().get("expert_bias")
        if bias is not None:
            assert bias.abs().max() > 0
            assert torch.equal(ours.layers[key].feed_forward.expert_bias, bias)
