"""train.loss_chunks and multi-token prediction reproduce the one-process run on the last stage
of a pipeline with a tensor-parallel, sequence-parallel head: the vocab-parallel loss on each
chunk, and two MTP depths there, which embed the tokens ahead with the last stage's copy of
the embedding (its gradient summed with the first stage's), run their blocks under TP x SP
and predict through the chunked head. The FSDP-sharded root's head with chunks runs in
tests/distributed/test_offload_parity.py, in the same launch as offload."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.distributed.harness import (
    FP32_TOLERANCE,
    assert_same_curve,
    assert_same_training,
    launch,
    max_relative_difference,
    run_pretrain,
)

pytestmark = pytest.mark.distributed

MTP = ["model.mtp_layers=2", "model.mtp_loss_weight=0.3"]


def mtp_losses(run_dir: Path, depth: int) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [row[f"mtp_loss_{depth}"] for row in rows]


def test_chunked_loss_and_mtp_on_a_tensor_parallel_last_stage_match_the_one_process_run(
    workdir: Path, grad_norm_tolerance
) -> None:
    reference = run_pretrain(workdir / "mtp_reference", MTP, nproc=1)
    overrides = ["parallel.pp=2", "parallel.tp=2", "parallel.sp=true", "train.loss_chunks=4"]
    curve = run_pretrain(workdir / "pp2_tp2_sp", [*MTP, *overrides], nproc=4)
    assert_same_curve(curve, reference, grad_norm_tolerance)
    for depth in (1, 2):
        got = mtp_losses(workdir / "pp2_tp2_sp", depth)
        expected = mtp_losses(workdir / "mtp_reference", depth)
        assert max_relative_difference(got, expected) <= FP32_TOLERANCE


def test_one_mtp_depth_under_dualpipev_beside_the_embedding_matches_the_one_process_run(
    workdir: Path, grad_norm_tolerance
) -> None:
    """DeepSeek-V3's one MTP depth under its V schedule: the last stage, with the MTP
    module's copy of the embedding, sits on the embedding's own rank. The copy's gradient
    is summed into the embedding's and it takes the embedding's weights before every step,
    the first after the resume from step 4 (a checkpoint holds the embedding once, as the
    one-process run's does), under ZeRO-2 and full recompute (the MTP block's too)."""
    one = ["model.mtp_layers=1", "model.mtp_loss_weight=0.3"]
    reference = run_pretrain(workdir / "mtp1_reference", one, nproc=1)
    run_dir = workdir / "mtp1_pp2_dualpipev"
    overrides = [*one, "parallel.pp=2", "parallel.vpp=2", "parallel.pp_schedule=dualpipev"]
    overrides += ["parallel.zero=2", "recompute.policy=full"]
    stopped = launch(run_dir, overrides, 2, env={"PRETRAIN_FAULT_STOP": "4"})
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    assert "stopped by SIGUSR1 after step 4; saved" in stopped.stdout
    curve = run_pretrain(run_dir, overrides, nproc=2)
    assert "resumed from the checkpoint of step 4" in (workdir / f"{run_dir.name}.log").read_text()
    # The stop at step 4 skips that step's evaluation: the resumed run evaluates at step 8.
    assert_same_training(curve, reference, grad_norm_tolerance)
    assert max_relative_difference(curve.val_loss, reference.val_loss[-1:]) <= FP32_TOLERANCE
    got = {
        row["step"]: row["mtp_loss_1"]
        for row in map(json.loads, (run_dir / "metrics.jsonl").open())
    }
    expected = mtp_losses(workdir / "mtp1_reference", 1)
    assert max_relative_difference([got[s] for s in sorted(got)], expected) <= FP32_TOLERANCE
