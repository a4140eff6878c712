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
