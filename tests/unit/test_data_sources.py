"""Every kind of source reads back exactly the tokens that were written: text, JSONL and
Parquet (compressed, in nested directories), Hugging Face save_to_disk, nanoGPT token
files and Megatron indexed datasets, each built here the way its own tools write it."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pretrain.dataprep.corpus import plan_units
from pretrain.dataprep.prepare import prepare_data
from pretrain.dataprep.sources import resolve_format, single_source
from pretrain.trainer.data.dataset import PreparedDataset, TokenStream
from tests.helpers import (
    data_recipe,
    encode_documents,
    generated_documents,
    write_jsonl,
    write_megatron,
)

DOCS = generated_documents(40, seed=1)


def prepared(cfg) -> tuple[PreparedDataset, list[int]]:
    """Prepare the recipe's one source in this process; the dataset and all its tokens."""
    [(place, manifest)] = prepare_data(cfg, report=lambda line: None, tty=False)
    dataset = PreparedDataset(place.folder)
    stream = TokenStream(dataset, dataset.everything())
    assert len(stream) == manifest["tokens"]
    return dataset, stream.read(0, len(stream)).tolist()


def test_a_nested_directory_of_compressed_shards_reads_every_file_in_path_order(
    tokenizer: Path, tmp_path: Path
) -> None:
    root = tmp_path / "corpus"
    parts = [DOCS[0:6], DOCS[6:12], DOCS[12:18], DOCS[18:24], DOCS[24:30]]
    write_jsonl(root / "a" / "1.jsonl.gz", parts[0])
    write_jsonl(root / "a" / "b" / "2.jsonl.zst", parts[1])
    write_jsonl(root / "c" / "3.json.bz2", parts[2])
    write_jsonl(root / "c" / "4.jsonl.xz", parts[3])
    (root / "d").mkdir()
    pq.write_table(pa.table({"text": parts[4]}), root / "d" / "5.parquet")
    (root / "e").mkdir()
    (root / "e" / "6.txt").write_text(DOCS[30])  # a text file is one document
    (root / "README.md").write_text("not data")
    (root / ".hidden.jsonl").write_text('{"text": "never read"}\n')
    _, tokens = prepared(data_recipe(str(root), tmp_path / "cache", tokenizer))
    expected = [*parts[0], *parts[1], *parts[2], *parts[3], *parts[4], DOCS[30]]
    assert tokens == encode_documents(tokenizer, expected)


def test_a_large_parquet_file_is_split_by_row_groups_into_units(
    tokenizer: Path, tmp_path: Path
) -> None:
    docs = generated_documents(1500, seed=2, words=(40, 80))
    path = tmp_path / "big.parquet"
    pq.write_table(pa.table({"body": docs}), path, row_group_size=50)
    cfg = data_recipe(str(path), tmp_path / "cache", tokenizer, text_field="body")
    units = plan_units(single_source(cfg.data, cfg.data.source))
    assert len(units) > 1 and all(u.row_groups for u in units)
    assert units[-1].row_groups[1] == 30
    _, tokens = prepared(cfg)
    assert tokens == encode_documents(tokenizer, docs)


def test_a_save_to_disk_dataset_and_a_split_of_a_dataset_dict(
    tokenizer: Path, tmp_path: Path
) -> None:
    datasets = pytest.importorskip("datasets")
    single = tmp_path / "single"
    datasets.Dataset.from_dict({"text": DOCS[:20]}).save_to_disk(str(single))
    cfg = data_recipe(str(single), tmp_path / "cache", tokenizer)
    assert resolve_format(single_source(cfg.data, cfg.data.source)) == "hf_disk"
    assert prepared(cfg)[1] == encode_documents(tokenizer, DOCS[:20])
    both = tmp_path / "dict"
    splits = {"train": DOCS[:5], "validation": DOCS[5:9]}
    datasets.DatasetDict(
        {k: datasets.Dataset.from_dict({"text": v}) for k, v in splits.items()}
    ).save_to_disk(str(both))
    cfg = data_recipe(str(both), tmp_path / "cache", tokenizer, split="validation")
    assert prepared(cfg)[1] == encode_documents(tokenizer, splits["validation"])


def test_a_megatron_indexed_dataset_is_read_in_place_with_its_documents(
    tokenizer: Path, tmp_path: Path
) -> None:
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 500, size=n).tolist() for n in (7, 1, 30, 12)]
    prefix = write_megatron(tmp_path / "mega_text_document", docs)
    cfg = data_recipe(str(prefix), tmp_path / "cache", tokenizer)
    dataset, tokens = prepared(cfg)
    assert tokens == [t for doc in docs for t in doc]
    assert dataset.document_ends(0).tolist() == np.cumsum([len(d) for d in docs]).tolist()
    assert Path(dataset.shards[0]["file"]) == Path(f"{prefix}.bin").resolve()  # not copied
    assert dataset.manifest["max_token_id"] == max(max(d) for d in docs)
    # The .bin or .idx path names the same dataset.
    for name in (f"{prefix}.bin", f"{prefix}.idx"):
        other = data_recipe(name, tmp_path / "cache", tokenizer)
        assert resolve_format(single_source(other.data, name)) == "megatron"


def test_a_nanogpt_token_file_splits_documents_at_eos_and_reads_meta_pkl(
    tokenizer: Path, tmp_path: Path
) -> None:
    ids = encode_documents(tokenizer, DOCS[:3])
    path = tmp_path / "train.bin"
    np.asarray(ids, dtype=np.uint16).tofile(path)
    (tmp_path / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": 320, "itos": {0: "a"}}))
    dataset, tokens = prepared(data_recipe(str(path), tmp_path / "cache", tokenizer))
    assert tokens == ids
    lengths = [len(encode_documents(tokenizer, [d])) for d in DOCS[:3]]
    assert dataset.document_ends(0).tolist() == np.cumsum(lengths).tolist()
    assert dataset.manifest["vocab_size"] == 320
    # Without a tokenizer the ids are used as they are, as one document.
    plain, tokens = prepared(data_recipe(str(path), tmp_path / "cache2", "none"))
    assert tokens == ids and plain.shards[0]["documents"] == 1
