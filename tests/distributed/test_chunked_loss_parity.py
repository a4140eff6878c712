"""train.loss_chunks reproduces the whole-logits loss where the head is parallel: on the last
stage of a pipeline with a tensor-parallel, sequence-parallel head (the vocab-parallel loss
on each chunk). The FSDP-sharded root's head with chunks runs in
tests/distributed/test_offload_parity.py, in the same launch as offload."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.harness import assert_same_curve, run_pretrain

pytestmark = pytest.mark.distributed


def test_chunked_loss_on_a_tensor_parallel_last_stage_matches_the_one_process_run(
    workdir: Path, harness_reference, grad_norm_tolerance
) -> None:
    overrides = ["parallel.pp=2", "parallel.tp=2", "parallel.sp=true", "train.loss_chunks=4"]
    curve = run_pretrain(workdir / "pp2_tp2_sp", overrides, nproc=4)
    assert_same_curve(curve, harness_reference, grad_norm_tolerance)
