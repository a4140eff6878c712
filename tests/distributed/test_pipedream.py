"""PipeDream-2BW under torchrun: the distributed pipeline computes what the one-process
simulation of the same schedule over the same stage modules computes, validation loss,
document masks, the chunked loss and tied embeddings included, and a run resumed from a checkpoint
continues bit for bit, both weight versions restored.

2BW's numerics differ from synchronous training by design (each step's gradient lands one
step late), so the reference is `tests.pipedream_oracle.pipedream_run`: the 2BW engines
of both stages in one process, fed and initialized as the trainer does. FP32, relative
1e-5 per step, as for every layout. The first step applies no update (NaN norm, logged as
null). Checkpoints every 2 steps drain the pipeline, which must not change the numerics.
The runs mask attention to documents, on a corpus of short ones (`doc_mask_overrides`), so
the second stage's attention must receive the documents too; they evaluate at steps 4 and
8, after a drain, on the weights the next step runs on (the oracle's newest); and their
loss applies the LM head in 2 chunks (`train.loss_chunks`), through the head of the version
each micro-batch's forward ran on, which the oracle computes whole (the head of the other
version, one update apart, would move the loss by far more than 1e-5). The embedding is
tied: the last stage's copy of it and the first stage's embedding, in each version, take
their summed gradient, which the oracle sums in one process.

Resume (test d): a crash while the checkpoint of step 6 is written leaves step 4's as the
newest complete one; the relaunched run restores it (the newest version as the model, the
older as the stash), replays steps 5-8 and must log the same losses and gradient norms
and end with the same two weight versions and optimizer states as the uninterrupted run,
bit for bit.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from pretrain.core.schema import load_config
from tests.distributed.harness import (
    FP32_TOLERANCE,
    assert_step_breakdown,
    launch,
    max_relative_difference,
    run_pretrain,
)
from tests.pipedream_oracle import pipedream_run

pytestmark = pytest.mark.distributed

TWO_BW = [
    "parallel.pp=2", "parallel.pp_schedule=2bw", "checkpoint.every=2", "checkpoint.keep=4",
    "train.loss_chunks=2", "model.tie_embeddings=true",
]  # fmt: skip


@pytest.fixture(scope="module")
def two_bw(doc_mask_overrides: list[str]) -> list[str]:
    return [*TWO_BW, *doc_mask_overrides]


def tensors(checkpoint: Path, out: Path) -> dict:
    """Every tensor of a DCP checkpoint, by key, read in this one process."""
    dcp_to_torch_save(checkpoint, out)
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def uninterrupted(workdir: Path, two_bw: list[str]):
    return run_pretrain(workdir / "2bw", two_bw, nproc=2)


def test_distributed_2bw_equals_the_one_process_schedule(workdir: Path, uninterrupted) -> None:
    reference, val = pipedream_run(load_config(str(workdir / "2bw" / "config.yaml")), 8)
    assert max_relative_difference(uninterrupted.loss, [x for x, _ in reference]) <= (
        FP32_TOLERANCE
    )
    assert uninterrupted.grad_norm[0] is None and math.isnan(reference[0][1])
    norms = [n for _, n in reference[1:]]
    assert max_relative_difference(uninterrupted.grad_norm[1:], norms) <= FP32_TOLERANCE
    assert len(val) == 2
    assert max_relative_difference(uninterrupted.val_loss, val) <= FP32_TOLERANCE
    assert_step_breakdown(workdir / "2bw", pp=2)


def test_d_resume_restores_both_weight_versions_exactly(
    workdir: Path, uninterrupted, two_bw: list[str]
) -> None:
    run = workdir / "2bw_resumed"
    crash = launch(run, two_bw, nproc=2, env={"PRETRAIN_FAULT_CRASH_IN_SAVE": "6"})
    assert crash.returncode != 0
    saved = tensors(run / "checkpoints" / "step_00000004", workdir / "step4.pt")
    # Two distinct versions: the newest (model) and the one step 5 runs on (stash).
    assert not torch.equal(saved["model"]["output.weight"], saved["stash"]["output.weight"])
    resumed = run_pretrain(run, two_bw, nproc=2)
    assert resumed.loss == uninterrupted.loss
    assert resumed.val_loss == uninterrupted.val_loss
    # Step 5 reports the update the drain before it applied; after a resume that drain ran
    # in the crashed process, so the resumed step 5 has no norm to report.
    assert resumed.grad_norm[4] is None
    assert resumed.grad_norm[:4] + resumed.grad_norm[5:] == (
        uninterrupted.grad_norm[:4] + uninterrupted.grad_norm[5:]
    )
    final = tensors(run / "checkpoints" / "step_00000008", workdir / "resumed.pt")
    expected = tensors(workdir / "2bw" / "checkpoints" / "step_00000008", workdir / "ref.pt")
    for part in ("model", "stash", "optim"):
        flat, flat_expected = flatten(final[part]), flatten(expected[part])
        assert flat.keys() == flat_expected.keys()
        for key, value in flat.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, flat_expected[key]), f"{part}.{key}"
            else:
                assert value == flat_expected[key], f"{part}.{key}"


def flatten(tree, prefix: str = "") -> dict:
    """The leaves (tensors, numbers, flags) of a nested state dict, by dotted key."""
    if isinstance(tree, dict):
        return {
            k: v for key, sub in tree.items() for k, v in flatten(sub, f"{prefix}{key}.").items()
        }
    if isinstance(tree, list):
        return {
            k: v for i, sub in enumerate(tree) for k, v in flatten(sub, f"{prefix}{i}.").items()
        }
    return {prefix.rstrip("."): tree}
