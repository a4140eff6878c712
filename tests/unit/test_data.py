"""The data pipeline: corpus, tokenizer, cached token file, packing, sampler and loader."""

from __future__ import annotations

import hashlib
import json
import multiprocessing
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from tokenizers import Tokenizer, models

from pretrain_core.schema import DataConfig
from trainer.corpus import iter_document_batches, stdlib_files
from trainer.data import (
    DataLoader,
    GlobalBatchSampler,
    PackedDataset,
    build_token_file,
    prepare_dataset,
)
from trainer.tokenizer import EOS_TOKEN, eos_id, load_tokenizer

SMALL_BYTES = 300_000
SMALL_VOCAB = 512
DOCS = [
    "def add(a, b):\n    return a + b\n",
    "Plain prose, with unicode: café ✓.",
    "x = [i * i for i in range(10)]\n" * 20,
    "",
    "last document",
]


def stdlib_config(cache: Path, max_bytes: int = SMALL_BYTES) -> DataConfig:
    return DataConfig(source="stdlib", max_bytes=max_bytes, cache_dir=str(cache))


@pytest.fixture(scope="module")
def trained_tokenizer(tmp_path_factory) -> Path:
    """A small byte-level BPE trained once on stdlib, saved as a plain tokenizer.json."""
    cache = tmp_path_factory.mktemp("tokenizer-cache")
    tokenizer = load_tokenizer(stdlib_config(cache), SMALL_VOCAB)
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    tokenizer.save(str(path))
    return path


def expected_tokens(tokenizer_path: Path, docs: list[str]) -> list[int]:
    tokenizer = load_tokenizer(DataConfig(tokenizer=str(tokenizer_path)), SMALL_VOCAB)
    out: list[int] = []
    for doc in docs:
        out += [*tokenizer.encode(doc, add_special_tokens=False).ids, eos_id(tokenizer)]
    return out


def flat_docs(data: DataConfig) -> list[str]:
    return [doc for batch in iter_document_batches(data) for doc in batch]


def test_stdlib_corpus_is_deterministic_sorted_and_capped_at_max_bytes(tmp_path):
    data = stdlib_config(tmp_path)
    first, second = flat_docs(data), flat_docs(data)
    assert first == second
    assert sum(len(doc.encode("utf-8")) for doc in first) == SMALL_BYTES
    readable = []
    for path in stdlib_files():
        try:
            readable.append(path.read_text(encoding="utf-8"))
        except UnicodeDecodeError:
            continue
        if len(readable) == len(first):
            break
    assert first[:-1] == readable[: len(first) - 1]
    assert readable[len(first) - 1].startswith(first[-1])
    assert all("site-packages" not in path.parts for path in stdlib_files())


def test_trained_tokenizer_round_trips_text_with_requested_vocab_and_eos(tmp_path):
    tokenizer = load_tokenizer(stdlib_config(tmp_path), SMALL_VOCAB)
    assert tokenizer.get_vocab_size() == SMALL_VOCAB
    assert eos_id(tokenizer) == tokenizer.token_to_id(EOS_TOKEN)
    text = flat_docs(stdlib_config(tmp_path))[0] + DOCS[1]
    assert tokenizer.decode(tokenizer.encode(text).ids) == text


def test_tokenizer_with_more_ids_than_the_model_embedding_is_refused(trained_tokenizer):
    data = DataConfig(tokenizer=str(trained_tokenizer))
    with pytest.raises(ValueError, match=f"set model.vocab_size to at least {SMALL_VOCAB}"):
        load_tokenizer(data, SMALL_VOCAB - 1)


def test_pretrained_directory_takes_eos_from_tokenizer_config(trained_tokenizer, tmp_path):
    tokenizer = Tokenizer.from_file(str(trained_tokenizer))
    tokenizer.add_special_tokens(["<|im_end|>"])
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    config = {"eos_token": {"content": "<|im_end|>", "special": True}}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    loaded = load_tokenizer(DataConfig(tokenizer=str(tmp_path)), SMALL_VOCAB + 1)
    assert eos_id(loaded) == tokenizer.token_to_id("<|im_end|>") != tokenizer.token_to_id(EOS_TOKEN)


def test_pretrained_tokenizer_without_an_eos_is_refused(tmp_path):
    Tokenizer(models.WordLevel({"a": 0, "b": 1}, unk_token="a")).save(str(tmp_path / "t.json"))
    with pytest.raises(ValueError, match="no end-of-sequence token"):
        load_tokenizer(DataConfig(tokenizer=str(tmp_path / "t.json")), 8)


def test_token_file_is_reused_and_its_key_follows_max_bytes_and_vocab(tmp_path, capsys):
    data = stdlib_config(tmp_path)
    first = prepare_dataset(data, vocab_size=SMALL_VOCAB, seq_len=64)
    tokens_file = first.folder / "tokens.bin"
    mtime = tokens_file.stat().st_mtime_ns
    second = prepare_dataset(data, vocab_size=SMALL_VOCAB, seq_len=64)
    assert capsys.readouterr().out.count("data: tokenized") == 1
    assert second.folder == first.folder and tokens_file.stat().st_mtime_ns == mtime
    smaller = prepare_dataset(
        stdlib_config(tmp_path, max_bytes=SMALL_BYTES // 2), vocab_size=SMALL_VOCAB, seq_len=64
    )
    bigger_vocab = prepare_dataset(data, vocab_size=2 * SMALL_VOCAB, seq_len=64)
    assert len({first.folder, smaller.folder, bigger_vocab.folder}) == 3
    assert len(smaller) < len(first)


def _prepare_and_digest(data: DataConfig, barrier, results) -> None:
    barrier.wait()  # start all builders at the same moment
    dataset = prepare_dataset(data, vocab_size=SMALL_VOCAB, seq_len=64)
    digest = hashlib.sha256(np.asarray(dataset.tokens).tobytes()).hexdigest()
    results.put((str(dataset.folder), digest))


def test_concurrent_builders_build_once_and_read_the_same_tokens(tmp_path, capfd):
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(3), ctx.Queue()
    data = stdlib_config(tmp_path)
    procs = [
        ctx.Process(target=_prepare_and_digest, args=(data, barrier, results)) for _ in range(3)
    ]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=120)
    assert [proc.exitcode for proc in procs] == [0, 0, 0]
    outcomes = [results.get(timeout=5) for _ in procs]
    out = capfd.readouterr().out
    assert out.count("data: trained byte-level BPE") == 1
    assert out.count("data: tokenized") == 1
    assert len(set(outcomes)) == 1
    meta = json.loads((Path(outcomes[0][0]) / "meta.json").read_text())
    assert meta["builder_pid"] in {proc.pid for proc in procs}


def write_source(folder: Path, kind: str) -> Path:
    """DOCS as local files of one kind; returns the source path to configure."""
    folder.mkdir()
    if kind == "txt":
        for i, doc in enumerate(DOCS):
            (folder / f"doc{i:02d}.txt").write_text(doc)
        return folder
    if kind == "jsonl":
        lines = [json.dumps({"body": doc, "id": i}) for i, doc in enumerate(DOCS)]
        (folder / "a.jsonl").write_text("\n".join(lines[:2]) + "\n")
        (folder / "b.jsonl").write_text("\n".join(lines[2:]) + "\n")
        return folder / "*.jsonl"
    table = pa.table({"body": DOCS, "id": list(range(len(DOCS)))})
    pq.write_table(table, folder / "docs.parquet")
    return folder / "docs.parquet"


@pytest.mark.parametrize("kind", ["txt", "jsonl", "parquet"])
def test_local_sources_tokenize_every_document_followed_by_eos(kind, trained_tokenizer, tmp_path):
    source = write_source(tmp_path / "src", kind)
    data = DataConfig(
        source=str(source),
        text_field="body",
        tokenizer=str(trained_tokenizer),
        cache_dir=str(tmp_path / "cache"),
    )
    dataset = prepare_dataset(data, vocab_size=SMALL_VOCAB, seq_len=8)
    assert dataset.tokens.tolist() == expected_tokens(trained_tokenizer, DOCS)


def test_missing_text_field_is_a_clear_error(trained_tokenizer, tmp_path):
    source = write_source(tmp_path / "src", "jsonl")
    data = DataConfig(source=str(source), tokenizer=str(trained_tokenizer), cache_dir=str(tmp_path))
    with pytest.raises(ValueError, match=r"data.text_field='text': no such column.*'body'"):
        prepare_dataset(data, vocab_size=SMALL_VOCAB, seq_len=8)


def test_packed_sequences_shift_targets_by_one_and_cross_documents(trained_tokenizer, tmp_path):
    data = DataConfig(
        source=str(write_source(tmp_path / "src", "txt")),
        tokenizer=str(trained_tokenizer),
        cache_dir=str(tmp_path / "cache"),
    )
    seq_len = 8
    tokens = expected_tokens(trained_tokenizer, DOCS)
    dataset = prepare_dataset(data, vocab_size=SMALL_VOCAB, seq_len=seq_len)
    assert len(dataset) == (len(tokens) - 1) // seq_len
    for i in range(len(dataset)):
        inputs, targets = dataset[i]
        assert inputs.tolist() == tokens[i * seq_len : (i + 1) * seq_len]
        assert targets.tolist() == tokens[i * seq_len + 1 : (i + 1) * seq_len + 1]
    doc_ends = np.cumsum([len(expected_tokens(trained_tokenizer, [doc])) for doc in DOCS]) - 1
    assert np.flatnonzero(dataset.tokens == dataset.eos_id).tolist() == doc_ends.tolist()
    inputs, targets = dataset.batch(np.arange(len(dataset)))
    assert inputs.dtype == targets.dtype == torch.long
    assert inputs.shape == targets.shape == (len(dataset), seq_len)


def test_corpus_shorter_than_one_sequence_is_refused(trained_tokenizer, tmp_path):
    data = DataConfig(
        source=str(write_source(tmp_path / "src", "txt")),
        tokenizer=str(trained_tokenizer),
        cache_dir=str(tmp_path / "cache"),
    )
    tokenizer = load_tokenizer(data, SMALL_VOCAB)
    folder = build_token_file(data, tokenizer)
    too_long = len(expected_tokens(trained_tokenizer, DOCS))
    with pytest.raises(ValueError, match="fewer than one sequence"):
        PackedDataset(folder, too_long)


LAYOUTS = [(1, 16), (1, 4), (2, 8), (2, 4), (4, 1), (4, 2), (8, 2), (16, 1)]


def test_every_layout_sees_exactly_the_global_batch_across_epochs():
    sampler = GlobalBatchSampler(num_sequences=50, global_batch=16, seed=3)
    for step in range(8):  # 8 * 16 = 128 positions: past two epoch boundaries
        expected = np.sort(sampler.global_batch_indices(step))
        for dp_size, micro_batch in LAYOUTS:
            shares = [
                mb
                for rank in range(dp_size)
                for mb in sampler.rank_micro_batches(step, rank, dp_size, micro_batch)
            ]
            assert all(len(mb) == micro_batch for mb in shares)
            assert np.array_equal(np.sort(np.concatenate(shares)), expected)


def test_each_epoch_is_a_fresh_permutation_of_all_sequences():
    n, g = 48, 16
    sampler = GlobalBatchSampler(num_sequences=n, global_batch=g, seed=0)
    stream = np.concatenate([sampler.global_batch_indices(step) for step in range(3 * n // g)])
    epochs = stream.reshape(3, n)
    for epoch in epochs:
        assert np.array_equal(np.sort(epoch), np.arange(n))
    assert not np.array_equal(epochs[0], epochs[1])
    other_seed = GlobalBatchSampler(num_sequences=n, global_batch=g, seed=1)
    assert not np.array_equal(other_seed.global_batch_indices(0), sampler.global_batch_indices(0))


def test_indivisible_global_batch_is_a_clear_error():
    sampler = GlobalBatchSampler(num_sequences=50, global_batch=16, seed=0)
    with pytest.raises(ValueError, match=r"global_batch=16 is not divisible by dp_size \(3\)"):
        sampler.rank_micro_batches(0, 0, dp_size=3, micro_batch=2)


@pytest.fixture
def small_dataset(trained_tokenizer, tmp_path) -> PackedDataset:
    data = DataConfig(
        source=str(write_source(tmp_path / "src", "jsonl")),
        text_field="body",
        tokenizer=str(trained_tokenizer),
        cache_dir=str(tmp_path / "cache"),
    )
    return prepare_dataset(data, vocab_size=SMALL_VOCAB, seq_len=4)


def as_lists(step: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[list, list]]:
    return [(inputs.tolist(), targets.tolist()) for inputs, targets in step]


def test_loader_state_round_trip_resumes_at_the_same_batches(small_dataset):
    sampler = GlobalBatchSampler(len(small_dataset), global_batch=8, seed=5)
    loader = DataLoader(small_dataset, sampler, dp_rank=1, dp_size=2, micro_batch=2)
    for _ in range(3):
        loader.next_step()
    state = json.loads(json.dumps(loader.state_dict()))  # as a checkpoint would store it
    expected = [as_lists(loader.next_step()) for _ in range(4)]

    resumed = DataLoader(small_dataset, sampler, dp_rank=1, dp_size=2, micro_batch=2)
    resumed.load_state_dict(state)
    assert [as_lists(resumed.next_step()) for _ in range(4)] == expected
    step = expected[0]
    assert len(step) == 2 and all(len(inputs) == 2 for inputs, _ in step)


def test_loader_state_resumes_under_another_layout(small_dataset):
    sampler = GlobalBatchSampler(len(small_dataset), global_batch=8, seed=5)
    single = DataLoader(small_dataset, sampler, dp_rank=0, dp_size=1, micro_batch=8)
    single.next_step()
    state = single.state_dict()
    ((inputs, _),) = single.next_step()
    rows = []
    for rank in range(4):
        loader = DataLoader(small_dataset, sampler, dp_rank=rank, dp_size=4, micro_batch=1)
        loader.load_state_dict(state)
        rows += [row for mb_inputs, _ in loader.next_step() for row in mb_inputs.tolist()]
    assert sorted(rows) == sorted(inputs.tolist())


def test_loader_refuses_state_from_another_seed_or_dataset(small_dataset):
    sampler = GlobalBatchSampler(len(small_dataset), global_batch=8, seed=5)
    loader = DataLoader(small_dataset, sampler, dp_rank=0, dp_size=1, micro_batch=8)
    state = loader.state_dict()
    with pytest.raises(ValueError, match="seed: saved 6, now 5"):
        loader.load_state_dict({**state, "seed": 6})
    with pytest.raises(ValueError, match="num_sequences: saved"):
        loader.load_state_dict({**state, "num_sequences": state["num_sequences"] + 1})


def test_hf_cache_stays_under_the_cache_dir(trained_tokenizer, tmp_path):
    data = DataConfig(
        source=str(write_source(tmp_path / "src", "txt")),
        tokenizer=str(trained_tokenizer),
        cache_dir=str(tmp_path / "cache"),
    )
    prepare_dataset(data, vocab_size=SMALL_VOCAB, seq_len=8)
    assert (tmp_path / "cache" / "huggingface" / "text").is_dir()
