"""train.loss_chunks reproduces the whole-logits loss where the head is parallel: under
TP + SP with ZeRO-3 (the vocab-parallel loss on each chunk, the root's head unsharded by
FSDP) and on the last stage of a pipeline with a tensor-parallel head."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.harness import assert_same_curve, run_pretrain

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize(
    ("label", "overrides", "nproc"),
    [
        ("tp2_sp_zero3", ["parallel.tp=2", "parallel.sp=true", "parallel.zero=3"], 4),
        ("pp2_tp2_sp", ["parallel.pp=2", "parallel.tp=2", "parallel.sp=true"], 4),
    ],
)
def test_chunked_loss_matches_the_one_process_whole_logits_run(
    workdir: Path, harness_reference, label: str, overrides: list[str], nproc: int
) -> None:
    curve = run_pretrain(workdir / label, [*overrides, "train.loss_chunks=4"], nproc=nproc)
    assert_same_curve(curve, harness_reference)
