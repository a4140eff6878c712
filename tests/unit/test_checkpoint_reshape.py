"""What a checkpoint saved under one layout needs to load under another, beyond DCP's own
resharding: vocabulary rows padded for another tp, and a different optimizer-group count."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from pretrain.trainer.checkpoint.vocab_resize import load_resizing_vocab
from pretrain.trainer.optim.lr_schedule import spread_over_groups

DIM = 4


def saved_checkpoint(path: Path, vocab_rows: int, padded_rows: int) -> dict:
    """A one-process DCP checkpoint whose vocab weights (and an optimizer state of one) have
    `padded_rows` rows of which the last `padded_rows - vocab_rows` are zero, as under TP."""

    def padded() -> torch.Tensor:
        weight = torch.randn(padded_rows, DIM)
        weight[vocab_rows:] = 0
        return weight

    state = {
        "model": {
            "tok_embeddings.weight": padded(),
            "output.weight": padded(),
            "norm.weight": torch.randn(DIM),
        },
        "optim": {"state": {"output.weight": {"exp_avg": padded(), "step": torch.tensor(4.0)}}},
    }
    dcp.save(state, checkpoint_id=str(path), no_dist=True)
    return state


def empty_like_model(rows: int) -> dict:
    return {
        "model": {
            "tok_embeddings.weight": torch.full((rows, DIM), float("nan")),
            "output.weight": torch.full((rows, DIM), float("nan")),
            "norm.weight": torch.zeros(DIM),
        },
        "optim": {
            "state": {
                "output.weight": {"exp_avg": torch.zeros(rows, DIM), "step": torch.tensor(0.0)}
            }
        },
    }


def test_padded_rows_are_dropped_when_loading_a_smaller_vocabulary(tmp_path: Path) -> None:
    saved = saved_checkpoint(tmp_path, vocab_rows=5, padded_rows=6)
    target = empty_like_model(5)
    output = target["model"]["output.weight"]
    resized = load_resizing_vocab(target, tmp_path, no_dist=True)
    assert sorted(resized) == [
        "model.output.weight",
        "model.tok_embeddings.weight",
        "optim.state.output.weight.exp_avg",
    ]
    assert target["model"]["output.weight"] is output  # loaded in place, like DCP does
    for name in ("tok_embeddings.weight", "output.weight"):
        assert torch.equal(target["model"][name], saved["model"][name][:5])
    assert torch.equal(target["model"]["norm.weight"], saved["model"]["norm.weight"])
    exp_avg = target["optim"]["state"]["output.weight"]["exp_avg"]
    assert torch.equal(exp_avg, saved["optim"]["state"]["output.weight"]["exp_avg"][:5])


def test_zero_rows_are_added_when_loading_a_larger_padded_vocabulary(tmp_path: Path) -> None:
    saved = saved_checkpoint(tmp_path, vocab_rows=5, padded_rows=5)
    target = empty_like_model(8)
    load_resizing_vocab(target, tmp_path, no_dist=True)
    for name in ("tok_embeddings.weight", "output.weight"):
        assert torch.equal(target["model"][name][:5], saved["model"][name])
        assert torch.equal(target["model"][name][5:], torch.zeros(3, DIM))


def test_other_shape_changes_are_still_refused(tmp_path: Path) -> None:
    saved_checkpoint(tmp_path, vocab_rows=5, padded_rows=6)
    target = empty_like_model(6)
    target["model"]["norm.weight"] = torch.zeros(DIM + 1)
    with pytest.raises(CheckpointException, match=r"Size mismatch .* for model\.norm\.weight"):
        load_resizing_vocab(target, tmp_path, no_dist=True)


def scheduler(groups: int, base_lr: float = 3e-3) -> dict:
    return {
        "base_lrs": [base_lr] * groups,
        "last_epoch": 4,
        "_step_count": 5,
        "_last_lr": [base_lr / 2] * groups,
        "lr_lambdas": [{}] * groups,
    }


def test_the_schedule_spreads_over_another_group_count() -> None:
    assert spread_over_groups(scheduler(3), 2) == scheduler(2)
    assert spread_over_groups(scheduler(2), 5) == scheduler(5)


def test_a_schedule_with_different_group_lrs_cannot_be_spread() -> None:
    saved = scheduler(2)
    saved["base_lrs"] = [3e-3, 1e-3]
    with pytest.raises(ValueError, match="differs between its 2 parameter groups"):
        spread_over_groups(saved, 3)
