"""Real corpora end to end: `pretrain action=prepare` tokenizes a generated multi-file corpus
(plain, gzip and zstd JSONL in nested dirs) with 2 worker processes, is stopped part-way,
resumes without redoing finished units, and the run trained from it has exactly the loss
curve of a run on the same text as one flat token file (the single-file path: each
document's ids and EOS, back to back, as a nanoGPT .bin). A mixture of the two trains with
exact shares and reports the tokens each source supplied. A nanoGPT folder (train.bin and
val.bin) trains with the validation loss of its val.bin."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pretrain.dataprep.sources import MANIFEST
from tests.distributed.harness import BASE_OVERRIDES, launch, read_curve, run_pretrain
from tests.helpers import encode_documents, generated_documents, pretrain, write_jsonl

pytestmark = pytest.mark.distributed

NO_VALIDATION = ["data.val_fraction=0", "eval.every=0"]


def common(workdir: Path) -> list[str]:
    return [f"data.cache_dir={workdir / 'cache'}", *NO_VALIDATION]


@pytest.fixture(scope="module")
def corpus(workdir: Path) -> tuple[Path, list[str]]:
    """16 files of 60 documents; the documents in the order the source reads them."""
    docs = generated_documents(16 * 60, seed=21)
    root = workdir / "corpus"
    names = [f"shard-{i:02d}.jsonl" for i in range(12)] + ["z/a.jsonl.gz", "z/b.jsonl.gz"]
    names += ["z/deeper/c.jsonl.zst", "z/deeper/d.jsonl.zst"]
    paths = [write_jsonl(root / name, docs[60 * i : 60 * (i + 1)]) for i, name in enumerate(names)]
    order = sorted(range(len(paths)), key=lambda i: paths[i].resolve().as_posix())
    return root, [doc for i in order for doc in docs[60 * i : 60 * (i + 1)]]


def prepare(run_dir: Path, source: Path, env: dict[str, str] | None = None):
    overrides = [
        *BASE_OVERRIDES,
        f"data.source={source}",
        "data.workers=2",
        *common(run_dir.parent),
    ]
    return pretrain(*overrides, "action=prepare", f"run.dir={run_dir}", cwd=run_dir.parent, env=env)


@pytest.fixture(scope="module")
def prepared(workdir: Path, corpus) -> Path:
    """The corpus prepared in two goes: stopped after 3 units, then resumed."""
    root, _ = corpus
    stopped = prepare(workdir / "prepare", root, {"PRETRAIN_FAULT_PREPARE_STOP": "3"})
    assert stopped.returncode != 0, stopped.stdout
    assert "finished units are kept, run again to resume" in stopped.stderr
    [folder] = [p for p in (workdir / "cache" / "datasets").iterdir() if p.is_dir()]
    assert not (folder / MANIFEST).exists()
    markers = {p.name: p.stat().st_mtime_ns for p in folder.glob("u*.json")}
    assert 3 <= len(markers) < 14
    resumed = prepare(workdir / "prepare", root)
    assert resumed.returncode == 0, resumed.stderr
    assert f"{len(markers)} of 14 units already done" in resumed.stdout
    assert "prepare " in resumed.stdout and "tok/s" in resumed.stdout  # progress lines
    assert all((folder / n).stat().st_mtime_ns == t for n, t in markers.items())
    manifest = json.loads((folder / MANIFEST).read_text())
    assert manifest["units"] == 14 and manifest["workers"] == 2
    return folder


def single_file(workdir: Path, prepared: Path, docs: list[str]) -> Path:
    """The old single-file layout of the same text: every document's ids and EOS, flat."""
    path = workdir / "flat" / "train.bin"
    path.parent.mkdir(exist_ok=True)
    np.asarray(encode_documents(prepared / "tokenizer.json", docs), dtype=np.uint16).tofile(path)
    return path


def test_a_stopped_and_resumed_preparation_trains_like_the_single_file_path(
    workdir: Path, corpus, prepared: Path
) -> None:
    root, docs = corpus
    made = (prepared / MANIFEST).stat().st_mtime_ns
    sharded = run_pretrain(workdir / "sharded", [f"data.source={root}", *common(workdir)], 2)
    assert (prepared / MANIFEST).stat().st_mtime_ns == made  # read, not prepared again
    flat = single_file(workdir, prepared, docs)
    tokenizer = prepared / "tokenizer.json"
    overrides = [f"data.source={flat}", f"data.tokenizer={tokenizer}", *common(workdir)]
    single = run_pretrain(workdir / "single", overrides, 2)
    assert sharded.loss == single.loss
    assert sharded.grad_norm == single.grad_norm


def test_a_mixture_draws_its_shares_and_reports_tokens_per_source(
    workdir: Path, corpus, prepared: Path
) -> None:
    root, docs = corpus
    flat = single_file(workdir, prepared, docs)
    sources = f"data.sources=[{{source:{root},weight:3}},{{source:{flat},weight:1,name:flat}}]"
    overrides = [sources, f"data.tokenizer={prepared / 'tokenizer.json'}", *common(workdir)]
    curve = run_pretrain(workdir / "mixture", overrides, 2)
    rows = [json.loads(line) for line in (workdir / "mixture" / "metrics.jsonl").open()]
    seq_len, batch = 64, 8  # the harness's train.seq_len and global_batch
    for row in rows:
        assert row["tokens_seen_corpus"] == 6 * row["step"] * seq_len
        assert row["tokens_seen_flat"] == 2 * row["step"] * seq_len
        assert row["tokens_seen_corpus"] + row["tokens_seen_flat"] == row["step"] * batch * seq_len
    assert curve.loss[-1] < curve.loss[0]


def test_a_nanogpt_folder_trains_with_the_validation_loss_of_its_val_bin(workdir: Path) -> None:
    folder = workdir / "nanogpt"
    folder.mkdir()
    rng = np.random.default_rng(3)
    rng.integers(0, 500, 20_000).astype(np.uint16).tofile(folder / "train.bin")
    rng.integers(0, 500, 2_000).astype(np.uint16).tofile(folder / "val.bin")
    base = tuple(o for o in BASE_OVERRIDES if not o.startswith("data.val_fraction"))
    run_dir = workdir / "nanogpt_run"
    overrides = [
        f"data.source={folder / 'train.bin'}", "data.tokenizer=none",
        f"data.cache_dir={workdir / 'cache'}", "train.steps=4", "eval.every=2",
    ]  # fmt: skip
    result = launch(run_dir, overrides, 1, base=base)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"data.val_source={folder / 'val.bin'} (nanoGPT's val.bin" in result.stderr
    curve = read_curve(run_dir / "metrics.jsonl")
    assert len(curve.val_loss) == 2 and all(np.isfinite(curve.val_loss))
