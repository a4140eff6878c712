"""Every pipeline layout reproduces the single-process loss and grad-norm curves.

FP32 on CPU, the harness's 4-layer model (pp=2 x vpp=2 gives one layer per stage): the
global batch, data order and initial weights are those of the reference, so the curves must
agree within the same relative 1e-5 as the data-parallel layouts. Every layout, and the
one-process reference, logs the whole step breakdown at every step: forward, backward,
optimizer and blocked time, and in a pipeline the bubble, each also per pipeline rank.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.harness import (
    FP32_TOLERANCE,
    Layout,
    TrainedTogether,
    assert_same_curve,
    assert_step_breakdown,
    logged_rows,
    max_relative_difference,
    run_pretrain,
    train_together,
)

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def reference(harness_reference):
    return harness_reference


LAYOUTS = {
    "gpipe_pp2": Layout(("parallel.pp=2", "parallel.pp_schedule=gpipe"), 2),
    "1f1b_pp2": Layout(("parallel.pp=2", "parallel.pp_schedule=1f1b"), 2),
    "interleaved_pp2_vpp2": Layout(
        ("parallel.pp=2", "parallel.vpp=2", "parallel.pp_schedule=interleaved_1f1b"), 2
    ),
    "zero_bubble_pp2": Layout(("parallel.pp=2", "parallel.pp_schedule=zero_bubble"), 2),
    # Both the input and the weight pass run a compiled block's backward (parallel/compile.py).
    "zero_bubble_pp2_compiled": Layout(
        (
            "parallel.pp=2",
            "parallel.pp_schedule=zero_bubble",
            "parallel.zero=2",
            "compile.enabled=true",
            "compile.backend=aot_eager",
        ),
        4,
    ),
    "uneven_1f1b_pp2_recompute": Layout(
        ("parallel.pp=2", "parallel.pp_layers=[1,3]", "recompute=full", "recompute.every=2"), 2
    ),
    # DDP under a pipeline runs on FSDP2's replicate (ZeRO-3 with pp: the 3-D tests).
    "1f1b_pp2_ddp_dp2": Layout(("parallel.pp=2", "parallel.zero=0"), 4),
}
"""Each layout, by label."""


@pytest.fixture(scope="module")
def trained(workdir: Path) -> TrainedTogether:
    """The layouts, those of one world size in one launch."""
    return train_together(workdir, LAYOUTS)


@pytest.mark.parametrize("label", LAYOUTS)
def test_pipeline_layout_matches_reference(trained, reference, grad_norm_tolerance, label) -> None:
    assert_same_curve(trained.curve(label), reference, grad_norm_tolerance)
    assert_step_breakdown(trained.dirs[label], pp=2)


def test_the_one_process_run_logs_the_step_breakdown(harness_reference_dir) -> None:
    assert_step_breakdown(harness_reference_dir, pp=1)


def test_tied_embeddings_under_pp2_match_the_single_process_run(
    workdir, grad_norm_tolerance
) -> None:
    """The last stage's copy of the embedding, its gradient summed with the first stage's
    every step, trains exactly as the one shared weight does in one process: across two
    ranks (1F1B), and under ZB-V, whose rank 0 holds both the first and the last stage."""
    tied = ["model.tie_embeddings=true"]
    reference = run_pretrain(workdir / "tied_reference", tied, nproc=1)
    curve = run_pretrain(workdir / "tied_pp2", [*tied, "parallel.pp=2"], nproc=2)
    assert_same_curve(curve, reference, grad_norm_tolerance)
    v_shape = ["parallel.vpp=2", "parallel.pp_schedule=zbv"]
    curve = run_pretrain(workdir / "tied_pp2_zbv", [*tied, "parallel.pp=2", *v_shape], nproc=2)
    assert_same_curve(curve, reference, grad_norm_tolerance)


def test_pp2_tp2_sp_matches_the_reference_in_its_task_scores_and_monitors_too(
    workdir, reference, harness_reference_dir, monitored_overrides, grad_norm_tolerance
) -> None:
    """Pipeline, tensor and sequence parallelism at once score the downstream task (the
    vocab-parallel log-softmax, forward only through the stages) and sample the stability
    monitors (norms summed over shards and stages, block outputs over sequence shards, the
    z-mean over vocabulary shards) as one process does."""
    layout = ["parallel.pp=2", "parallel.tp=2", "parallel.sp=true"]
    curve = run_pretrain(workdir / "1f1b_pp2_tp2_sp", [*layout, *monitored_overrides], nproc=4)
    assert_same_curve(curve, reference, grad_norm_tolerance)
    prefixes = ("eval/", "stability/")
    expected = logged_rows(harness_reference_dir, prefixes)
    measured = logged_rows(workdir / "1f1b_pp2_tp2_sp", prefixes)
    assert sorted(expected) == sorted(measured) == [4, 8]
    for step, values in expected.items():
        assert measured[step].keys() == values.keys()
        scores = {k: v for k, v in values.items() if k.startswith("eval/")}
        assert scores and {k: measured[step][k] for k in scores} == scores
    # The monitors at their first sample (step 4), where the weights have moved apart by
    # three steps' rounding only: the forward's values and the weights agree as the losses
    # do, the gradient and the update derived from it as the gradient norm does.
    for name, value in expected[4].items():
        gradient = "grad_norm" in name or "update_ratio" in name
        bound = grad_norm_tolerance if gradient else FP32_TOLERANCE
        assert max_relative_difference([measured[4][name]], [value]) <= bound, name
