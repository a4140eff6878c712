"""Which checkpoints count as complete, the Hugging Face names of our parameters, and how a
straggler is named."""

from __future__ import annotations

from pathlib import Path

import pytest

import models
from trainer.checkpoint import DCP_METADATA, META, complete_checkpoints, find_checkpoint, step_dir
from trainer.export import hf_name
from trainer.faults import slowest_rank


def make_checkpoint(root: Path, step: int, *, meta: bool = True, suffix: str = "") -> Path:
    path = step_dir(root, step)
    path = path.with_name(path.name + suffix)
    path.mkdir(parents=True)
    (path / DCP_METADATA).write_bytes(b"")
    if meta:
        (path / META).write_text("{}")
    return path


def test_only_renamed_checkpoints_with_metadata_count(tmp_path: Path) -> None:
    two = make_checkpoint(tmp_path, 2)
    ten = make_checkpoint(tmp_path, 10)
    make_checkpoint(tmp_path, 12, suffix=".tmp")  # crashed mid-save
    make_checkpoint(tmp_path, 14, meta=False)  # not marked complete
    assert complete_checkpoints(tmp_path) == [(2, two), (10, ten)]
    assert find_checkpoint(tmp_path) == ten
    assert find_checkpoint(tmp_path, step=2) == two
    assert find_checkpoint(tmp_path, step=12) is None


def test_a_run_without_checkpoints_has_none(tmp_path: Path) -> None:
    assert complete_checkpoints(tmp_path / "missing") == []
    assert find_checkpoint(tmp_path / "missing") is None


def test_every_parameter_has_a_distinct_hugging_face_llama_name() -> None:
    names = [name for name, _ in models.build(models.ModelConfig(n_layers=2)).named_parameters()]
    hf = [hf_name(name) for name in names]
    assert len(set(hf)) == len(names)
    assert hf_name("layers.1.attention.wk.weight") == "model.layers.1.self_attn.k_proj.weight"
    assert hf_name("layers.0.feed_forward.w1.weight") == "model.layers.0.mlp.gate_proj.weight"
    assert hf_name("output.weight") == "lm_head.weight"


@pytest.mark.parametrize(
    ("times", "lag", "expected"),
    [
        ([1.0, 1.0, 1.0, 1.5], 0.25, (3, 0.5)),
        ([1.0, 1.2, 1.0, 1.0], 0.25, None),
        ([2.0, 1.0, 1.0], 0.5, (0, 1.0)),
    ],
)
def test_the_slowest_rank_is_named_only_past_the_lag(times, lag, expected) -> None:
    found = slowest_rank(times, lag)
    if expected is None:
        assert found is None
    else:
        assert found[0] == expected[0]
        assert found[1] == pytest.approx(expected[1])
