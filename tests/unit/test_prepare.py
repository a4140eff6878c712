"""Preparation: resumable by unit, atomic, bounded shards, exact cuts at whole documents,
progress lines, and one builder at a time."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

import numpy as np
import pytest

from pretrain.dataprep.corpus import plan_units
from pretrain.dataprep.prepare import prepare_data
from pretrain.dataprep.progress import Progress
from pretrain.dataprep.shards import UnitJob, tokenize_unit
from pretrain.dataprep.sources import MANIFEST, single_source
from pretrain.trainer.data.dataset import PreparedDataset, TokenStream
from tests.helpers import (
    data_recipe,
    encode_documents,
    generated_documents,
    write_jsonl,
)

DOCS = generated_documents(600, seed=3)


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    """Twelve JSONL files of 50 documents: 12 units of work."""
    root = tmp_path / "corpus"
    for i in range(12):
        write_jsonl(root / f"part-{i:02d}.jsonl", DOCS[50 * i : 50 * (i + 1)])
    return root


def all_tokens(folder: Path) -> list[int]:
    dataset = PreparedDataset(folder)
    stream = TokenStream(dataset, dataset.everything())
    return stream.read(0, len(stream)).tolist()


def quiet(cfg):
    lines: list[str] = []
    [(place, manifest)] = prepare_data(cfg, report=lines.append, tty=False)
    return place.folder, manifest, lines


def test_a_stopped_preparation_resumes_redoing_only_the_unfinished_units(
    corpus: Path, tokenizer: Path, tmp_path: Path
) -> None:
    cfg = data_recipe(str(corpus), tmp_path / "cache", tokenizer)
    folder, manifest, _ = quiet(cfg)
    assert manifest["units"] == 12 and all_tokens(folder) == encode_documents(tokenizer, DOCS)
    # What a stop leaves: no manifest, some units unfinished, a half-written part.
    (folder / MANIFEST).unlink()
    for index in (4, 9):
        (folder / f"u{index:06d}.json").unlink()
    (folder / "u000009.000.bin.tmp").write_bytes(b"half a shard")
    kept = {p.name: p.stat().st_mtime_ns for p in folder.glob("u*.bin")}
    folder, resumed, lines = quiet(cfg)
    assert "resuming" in lines[0] and "10 of 12 units already done" in lines[0]
    assert all_tokens(folder) == encode_documents(tokenizer, DOCS)
    assert resumed["shards"] == manifest["shards"]
    redone = {n for n, t in kept.items() if (folder / n).stat().st_mtime_ns != t}
    assert redone == {"u000004.000.bin", "u000009.000.bin"}
    assert not list(folder.glob("*.tmp"))


def test_max_tokens_keeps_whole_documents_up_to_the_one_that_reaches_it(
    corpus: Path, tokenizer: Path, tmp_path: Path
) -> None:
    full = encode_documents(tokenizer, DOCS)
    limit = len(full) // 3
    folder, manifest, _ = quiet(
        data_recipe(str(corpus), tmp_path / "cache", tokenizer, max_tokens=limit)
    )
    tokens = all_tokens(folder)
    assert limit <= len(tokens) < limit + max(len(encode_documents(tokenizer, [d])) for d in DOCS)
    assert tokens == full[: len(tokens)]
    assert tokens[-1] == full[-1]  # ends on an EOS: a document boundary
    # Units past the cut leave nothing behind.
    used = {s["file"] for s in manifest["shards"]}
    assert {p.name for p in folder.glob("u*.bin")} == used


def test_max_bytes_counts_text_bytes_of_whole_documents(
    corpus: Path, tokenizer: Path, tmp_path: Path
) -> None:
    limit = 10_000
    _, manifest, lines = quiet(
        data_recipe(str(corpus), tmp_path / "cache", tokenizer, max_bytes=limit)
    )
    sizes = np.cumsum([len(d.encode()) for d in DOCS])
    kept = int(np.searchsorted(sizes, limit)) + 1
    assert manifest["documents"] == kept and manifest["text_bytes"] == sizes[kept - 1]
    # The cut is said, with what the dataset holds and how to take everything.
    [cut] = [line for line in lines if "is cut at" in line]
    assert f"is cut at data.max_bytes=10,000: the first {kept:,} documents" in cut
    assert f"{sizes[kept - 1]:,} bytes of text" in cut and "data.max_bytes=0 takes all" in cut
    _, _, whole = quiet(data_recipe(str(corpus), tmp_path / "cache2", tokenizer))
    assert not [line for line in whole if "is cut at" in line]


def test_units_depend_on_the_source_and_limits_not_the_workers(corpus: Path, tmp_path) -> None:
    cfg = data_recipe(str(corpus), tmp_path / "cache", "none")
    src = single_source(cfg.data, cfg.data.source)
    assert [u.files for u in plan_units(src)] == [(str(p),) for p in sorted(corpus.iterdir())]
    cfg.data.workers = 7
    assert plan_units(single_source(cfg.data, cfg.data.source)) == plan_units(src)


def test_shard_parts_are_bounded_and_cut_between_documents(
    corpus: Path, tokenizer: Path, tmp_path: Path
) -> None:
    from tokenizers import Tokenizer

    cfg = data_recipe(str(corpus), tmp_path / "cache", tokenizer)
    src = single_source(cfg.data, cfg.data.source)
    unit = plan_units(src)[0]
    tok = Tokenizer.from_file(str(tokenizer))
    out = tmp_path / "out"
    out.mkdir()
    record = tokenize_unit(UnitJob(src, unit, str(out), "uint16", 500), tok, 0, lambda *c: None)
    assert len(record["parts"]) > 1
    for part in record["parts"]:
        ends = np.load(out / part["docs"])[:, 0]
        assert part["tokens"] == ends[-1] == (out / part["file"]).stat().st_size // 2
        assert ends[-2] < 500  # full only at its last document
    assert json.loads((out / "u000000.json").read_text()) == record


def test_progress_lines_show_documents_tokens_speed_and_eta() -> None:
    lines: list[str] = []
    progress = Progress("corpus", units=4, total_bytes=4000, goals=(0, 0), report=lines.append)
    progress.add(documents=10, tokens=2500, text_bytes=1000)
    progress.unit_done(1000)
    progress.tick(force=True)
    progress.finish()
    assert "prepare corpus: 25%, 1 of 4 units, 10 docs, 2.5k tokens" in lines[0]
    assert "MB/s" in lines[0] and "tok/s" in lines[0] and "ETA" in lines[0]
    assert len(lines) == 2 and all("\r" not in line for line in lines)


def _prepare_in_child(cfg, barrier, results) -> None:
    barrier.wait()  # start both builders at the same moment
    lines: list[str] = []
    [(place, manifest)] = prepare_data(cfg, report=lines.append, tty=False)
    results.put((str(place.folder), manifest["tokens"], sum("shard(s) ->" in x for x in lines)))


def test_concurrent_preparations_build_once_and_agree(corpus: Path, tokenizer, tmp_path) -> None:
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    cfg = data_recipe(str(corpus), tmp_path / "cache", tokenizer)
    procs = [ctx.Process(target=_prepare_in_child, args=(cfg, barrier, results)) for _ in range(2)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=120)
    assert [proc.exitcode for proc in procs] == [0, 0]
    outcomes = [results.get(timeout=5) for _ in procs]
    assert {o[:2] for o in outcomes} == {(outcomes[0][0], len(encode_documents(tokenizer, DOCS)))}
    assert sorted(o[2] for o in outcomes) == [0, 1]  # one built, the other reused
