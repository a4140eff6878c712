"""A checkpoint's manifest catches a truncated or changed file and a garbled meta.json; bad
checkpoints are moved aside, never deleted; unfinished saves are removed; the bytes a save
needs are counted once per replica."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from pretrain.trainer.checkpoint.checkpointer import DCP_METADATA, META
from pretrain.trainer.checkpoint.integrity import (
    MANIFEST,
    checksum_problems,
    checksums,
    remove_unfinished,
    set_aside,
    size_problems,
    state_bytes,
    step_dirs,
    write_manifest,
)


def fake_checkpoint(path: Path) -> Path:
    """A checkpoint folder with two shards, rank RNG files, DCP metadata and meta.json."""
    (path / "rng").mkdir(parents=True)
    (path / "__0_0.distcp").write_bytes(b"a" * 1000)
    (path / "__1_0.distcp").write_bytes(b"b" * 1000)
    (path / "rng" / "rank_0.pt").write_bytes(b"r0")
    (path / "rng" / "rank_1.pt").write_bytes(b"r1")
    (path / DCP_METADATA).write_bytes(b"m")
    (path / META).write_text(json.dumps({"step": 2}))
    return path


def problems(path: Path) -> list[str]:
    found, names = size_problems(path, META, DCP_METADATA)
    return found or checksum_problems(path, names)


def test_the_manifest_lists_every_file_and_reuses_the_ranks_sums(tmp_path: Path) -> None:
    ckpt = fake_checkpoint(tmp_path / "step_00000002")
    known = checksums(ckpt, ["__0_0.distcp", "rng/rank_0.pt"])
    known["__0_0.distcp"]["sha256"] = "from-rank-0"
    write_manifest(ckpt, known)
    listed = json.loads((ckpt / MANIFEST).read_text())["files"]
    assert sorted(listed) == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.json",
                              "rng/rank_0.pt", "rng/rank_1.pt"]  # fmt: skip
    assert listed["__0_0.distcp"] == {"size": 1000, "sha256": "from-rank-0"}
    assert listed["__1_0.distcp"]["size"] == 1000


def test_an_intact_checkpoint_has_no_problems(tmp_path: Path) -> None:
    ckpt = fake_checkpoint(tmp_path / "step_00000002")
    write_manifest(ckpt, {})
    assert problems(ckpt) == []


def test_a_truncated_shard_is_named_with_both_sizes(tmp_path: Path) -> None:
    ckpt = fake_checkpoint(tmp_path / "step_00000002")
    write_manifest(ckpt, {})
    (ckpt / "__1_0.distcp").write_bytes(b"b" * 10)
    assert problems(ckpt) == ["__1_0.distcp is 10 bytes, the manifest says 1,000"]


def test_a_changed_byte_fails_the_checksum(tmp_path: Path) -> None:
    ckpt = fake_checkpoint(tmp_path / "step_00000002")
    write_manifest(ckpt, {})
    (ckpt / "__0_0.distcp").write_bytes(b"a" * 999 + b"X")
    assert problems(ckpt) == ["__0_0.distcp does not match its checksum"]


def test_garbled_or_missing_meta_json_is_a_problem(tmp_path: Path) -> None:
    garbled = fake_checkpoint(tmp_path / "step_00000002")
    (garbled / META).write_text("{not json")
    assert problems(garbled)[0].startswith("meta.json: not valid JSON")
    missing = fake_checkpoint(tmp_path / "step_00000004")
    (missing / META).unlink()
    assert problems(missing) == ["meta.json is missing"]


def test_a_checkpoint_from_before_manifests_is_accepted_when_its_meta_reads(tmp_path) -> None:
    assert problems(fake_checkpoint(tmp_path / "step_00000002")) == []


def test_bad_checkpoints_are_moved_aside_and_never_overwritten(tmp_path: Path) -> None:
    first = fake_checkpoint(tmp_path / "step_00000006")
    assert set_aside(first).name == "step_00000006.corrupt"
    again = fake_checkpoint(tmp_path / "step_00000006")
    assert set_aside(again).name == "step_00000006.corrupt.2"
    assert (tmp_path / "step_00000006.corrupt" / META).is_file()
    assert step_dirs(tmp_path) == []


def test_unfinished_saves_are_removed_and_checkpoints_listed_newest_first(tmp_path) -> None:
    two = fake_checkpoint(tmp_path / "step_00000002")
    four = fake_checkpoint(tmp_path / "step_00000004")
    fake_checkpoint(tmp_path / "step_00000006.tmp")
    assert [p.name for p in remove_unfinished(tmp_path)] == ["step_00000006.tmp"]
    assert step_dirs(tmp_path) == [(4, four), (2, two)]


def test_a_plain_tensor_counts_once_for_all_ranks() -> None:
    state = {"model": {"w": torch.zeros(10, 10)}, "optim": [torch.zeros(5)], "step": 3}
    assert state_bytes(state, rank=0) == 4 * 105
    assert state_bytes(state, rank=1) == 0
