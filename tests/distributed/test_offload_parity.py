"""parallel.offload=params (FSDP2's CPUOffloadPolicy: shards, gradients and the optimizer on
the host) reproduces the one-process run. On CPU the host is the device, so the policy moves
nothing, but its code path (host-resident shards, the optimizer built for the host, the
copies FSDP2 makes around each all-gather and reduce-scatter) runs and must match. The same
launch computes the loss in chunks (train.loss_chunks) through the root's head, which FSDP
keeps unsharded from forward to backward. One rank offloads too: FSDP2 then holds the whole
model state on it (ZeRO-Offload on a single GPU)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.harness import assert_same_curve, run_pretrain

pytestmark = pytest.mark.distributed


def test_zero3_offloaded_with_a_chunked_loss_matches_the_one_process_run(
    workdir: Path, harness_reference, grad_norm_tolerance
) -> None:
    overrides = ["parallel.zero=3", "parallel.offload=params", "train.loss_chunks=4"]
    curve = run_pretrain(workdir / "zero3_offload", overrides, nproc=2)
    assert_same_curve(curve, harness_reference, grad_norm_tolerance)
    # Every block and the root: FSDP2 was given the host-offload policy.
    log = (workdir / "zero3_offload.log").read_text()
    assert "optimizer fused" in log and "5 FSDP units offloaded to host memory" in log


def test_one_rank_offloads_its_whole_model_state_and_matches_the_one_process_run(
    workdir: Path, harness_reference, grad_norm_tolerance
) -> None:
    overrides = ["parallel.zero=3", "parallel.offload=params"]
    curve = run_pretrain(workdir / "one_rank_offload", overrides, nproc=1)
    assert_same_curve(curve, harness_reference, grad_norm_tolerance)
    assert "5 FSDP units offloaded to host memory" in (workdir / "one_rank_offload.log").read_text()
