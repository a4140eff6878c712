"""The data a run reads: the stdlib corpus and its tokenizer, the validation split by
document, packed sequences across shards, and the loaders (resumable, layout-free)."""

from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models

from pretrain.core.schema import DataConfig, SourceConfig
from pretrain.dataprep.corpus import source_documents
from pretrain.dataprep.prepare import prepare_data
from pretrain.dataprep.sources import single_source, stdlib_files
from pretrain.dataprep.tokenizer import EOS_TOKEN, eos_id, load_tokenizer
from pretrain.trainer.data import dataset as dataset_module
from pretrain.trainer.data.dataset import PackedSequences, PreparedDataset, TokenStream
from pretrain.trainer.data.loader import (
    DataLoader,
    open_datasets,
    packed_data,
    train_loader,
    val_loader,
)
from pretrain.trainer.data.sampler import MixtureSampler
from tests.helpers import (
    data_recipe,
    encode_documents,
    generated_documents,
    write_jsonl,
)

SMALL_VOCAB = 512
DOCS = generated_documents(200, seed=5)


def stdlib_docs(max_bytes: int) -> list[str]:
    return [
        d for batch in source_documents(SourceConfig("stdlib", max_bytes=max_bytes)) for d in batch
    ]


def test_stdlib_corpus_is_deterministic_sorted_and_stops_at_the_document_reaching_max_bytes():
    first, second = stdlib_docs(300_000), stdlib_docs(300_000)
    assert first == second
    sizes = np.cumsum([len(doc.encode("utf-8")) for doc in first])
    assert sizes[-2] < 300_000 <= sizes[-1]
    readable = []
    for path in stdlib_files():
        try:
            readable.append(path.read_text(encoding="utf-8"))
        except UnicodeDecodeError:
            continue
        if len(readable) == len(first):
            break
    assert first == readable
    assert all("site-packages" not in path.parts for path in stdlib_files())


def test_trained_tokenizer_round_trips_text_with_requested_vocab_and_eos(tmp_path):
    data = DataConfig(source="stdlib", max_bytes=300_000, cache_dir=str(tmp_path))
    tokenizer = load_tokenizer(data, SMALL_VOCAB)
    assert tokenizer.get_vocab_size() == SMALL_VOCAB
    assert eos_id(tokenizer) == tokenizer.token_to_id(EOS_TOKEN)
    text = stdlib_docs(1)[0] + "Plain prose, with unicode: café ✓."
    assert tokenizer.decode(tokenizer.encode(text).ids) == text


def test_tokenizer_with_more_ids_than_the_model_embedding_is_refused(tokenizer: Path):
    with pytest.raises(ValueError, match=r"set model\.vocab_size to at least 320"):
        load_tokenizer(DataConfig(tokenizer=str(tokenizer)), 319)


def test_pretrained_directory_takes_eos_from_tokenizer_config(tokenizer: Path, tmp_path):
    tok = Tokenizer.from_file(str(tokenizer))
    tok.add_special_tokens(["<|im_end|>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    config = {"eos_token": {"content": "<|im_end|>", "special": True}}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    loaded = load_tokenizer(DataConfig(tokenizer=str(tmp_path)), 400)
    assert eos_id(loaded) == tok.token_to_id("<|im_end|>") != tok.token_to_id(EOS_TOKEN)


def test_pretrained_tokenizer_without_an_eos_is_refused(tmp_path):
    Tokenizer(models.WordLevel({"a": 0, "b": 1}, unk_token="a")).save(str(tmp_path / "t.json"))
    with pytest.raises(ValueError, match="no end-of-sequence token"):
        load_tokenizer(DataConfig(tokenizer=str(tmp_path / "t.json")), 8)


@pytest.fixture(scope="module")
def sharded(tokenizer: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """DOCS in 8 files of 25 documents (8 shards), prepared; (cache, corpus)."""
    root = tmp_path_factory.mktemp("sharded")
    for i in range(8):
        write_jsonl(root / "corpus" / f"{i}.jsonl", DOCS[25 * i : 25 * (i + 1)])
    return root / "cache", root / "corpus"


def recipe(sharded, tokenizer: Path, **data):
    cache, corpus = sharded
    return data_recipe(str(corpus), cache, tokenizer, **data)


def test_the_validation_split_holds_out_whole_documents_at_the_end_of_every_shard(
    sharded, tokenizer: Path
) -> None:
    [(place, _)] = prepare_data(recipe(sharded, tokenizer), report=lambda _: None)
    dataset = PreparedDataset(place.folder)
    counts = [shard["documents"] for shard in dataset.shards]
    assert len(counts) > 1 and sum(counts) == 200
    train, val = dataset.split(0.1)
    held = 0
    for (s, first, cut), (s_val, val_first, end) in zip(train, val, strict=True):
        assert s == s_val and first == 0 and cut == val_first and end == dataset.shards[s]["tokens"]
        ends = dataset.document_ends(s)
        held += len(ends) - 1 - int(np.searchsorted(ends, cut))
        assert cut in ends  # a document boundary
    assert held == int(Fraction("0.1") * 200) == 20
    tokens = encode_documents(tokenizer, DOCS)
    train_stream = TokenStream(dataset, train)
    val_stream = TokenStream(dataset, val)
    assert len(train_stream) + len(val_stream) == len(tokens)
    # Shard s holds out its last floor(0.1 * C_s) - floor(0.1 * C_(s-1)) documents.
    val_docs, seen = [], 0
    for count in counts:
        held = int(Fraction("0.1") * (seen + count)) - int(Fraction("0.1") * seen)
        val_docs += DOCS[seen + count - held : seen + count]
        seen += count
    assert val_stream.read(0, len(val_stream)).tolist() == encode_documents(tokenizer, val_docs)


def test_packed_sequences_cross_shard_boundaries(sharded, tokenizer: Path, monkeypatch) -> None:
    monkeypatch.setattr(dataset_module, "OPEN_SHARDS", 2)
    [(place, _)] = prepare_data(recipe(sharded, tokenizer), report=lambda _: None)
    dataset = PreparedDataset(place.folder)
    tokens = encode_documents(tokenizer, DOCS)
    packed = PackedSequences(TokenStream(dataset, dataset.everything()), seq_len=50)
    assert len(packed) == (len(tokens) - 1) // 50
    for i in range(len(packed)):
        assert packed.sequence(i).tolist() == tokens[i * 50 : i * 50 + 51]
    assert len(dataset._open) <= 2  # shards mapped on demand, a bounded number at once
    with pytest.raises(ValueError, match="fewer than one sequence"):
        PackedSequences(TokenStream(dataset, dataset.everything()), seq_len=len(tokens))


def loader_for(cfg, dp_rank: int = 0, dp_size: int = 1) -> DataLoader:
    return train_loader(cfg, packed_data(cfg, open_datasets(cfg, True, print)), dp_rank, dp_size)


def as_lists(step: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[list, list]]:
    return [(inputs.tolist(), targets.tolist()) for inputs, targets in step]


def test_loader_state_round_trip_resumes_at_the_same_batches(sharded, tokenizer) -> None:
    cfg = recipe(sharded, tokenizer)
    cfg.train.global_batch = 8
    loader = loader_for(cfg, dp_rank=1, dp_size=2)
    for _ in range(3):
        loader.next_step()
    state = json.loads(json.dumps(loader.state_dict()))  # as a checkpoint would store it
    expected = [as_lists(loader.next_step()) for _ in range(4)]
    resumed = loader_for(cfg, dp_rank=1, dp_size=2)
    resumed.load_state_dict(state)
    assert [as_lists(resumed.next_step()) for _ in range(4)] == expected
    assert len(expected[0]) == 2 and all(len(inputs) == 2 for inputs, _ in expected[0])


def test_loader_state_resumes_under_another_layout(sharded, tokenizer) -> None:
    cfg = recipe(sharded, tokenizer)
    cfg.train.global_batch, cfg.train.micro_batch = 8, 8
    single = loader_for(cfg)
    single.next_step()
    state = single.state_dict()
    ((inputs, targets),) = single.next_step()
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    cfg.train.micro_batch = 1
    rows = []
    for rank in range(4):
        loader = loader_for(cfg, dp_rank=rank, dp_size=4)
        loader.load_state_dict(state)
        rows += [row for mb_inputs, _ in loader.next_step() for row in mb_inputs.tolist()]
    assert sorted(rows) == sorted(inputs.tolist())


def test_loader_refuses_state_from_another_seed_or_dataset(sharded, tokenizer) -> None:
    loader = loader_for(recipe(sharded, tokenizer))
    state = loader.state_dict()
    with pytest.raises(ValueError, match="seed: saved 6, now 1234"):
        loader.load_state_dict({**state, "seed": 6})
    with pytest.raises(ValueError, match="sequences: saved"):
        loader.load_state_dict({**state, "sequences": [state["sequences"][0] + 1]})


def test_a_mixture_reads_each_source_and_validates_on_the_splits_of_both(
    sharded, tokenizer, tmp_path
) -> None:
    _, corpus = sharded
    other = write_jsonl(tmp_path / "other.jsonl", generated_documents(60, seed=9))
    cfg = recipe(sharded, tokenizer, val_fraction=0.1)
    cfg.eval.every = 10
    cfg.data.sources = [
        SourceConfig(str(corpus), weight=3.0),
        SourceConfig(str(other), weight=1.0, name="other"),
    ]
    run = packed_data(cfg, open_datasets(cfg, True, print))
    assert run.labels == ["corpus", "other"] and len(run.train) == len(run.val) == 2
    loader = train_loader(cfg, run, 0, 1)
    assert loader.sampler.sequences_seen(25) == [75, 25]
    val = val_loader(cfg, run, 0, 1)
    assert val is not None and val.sampler.shuffle is False
    assert val.sampler.sizes == [len(v) for v in run.val]


def test_a_separate_validation_source_is_used_whole(sharded, tokenizer, tmp_path) -> None:
    val_docs = generated_documents(30, seed=11)
    val_path = write_jsonl(tmp_path / "val.jsonl.gz", val_docs)
    cfg = recipe(sharded, tokenizer, val_source=str(val_path))
    cfg.eval.every = 10
    run = packed_data(cfg, open_datasets(cfg, True, print))
    [val] = run.val
    assert len(val.stream) == len(encode_documents(tokenizer, val_docs))
    assert len(run.train[0].stream) == len(encode_documents(tokenizer, DOCS))
    assert single_source(cfg.data, cfg.data.val_source).source == str(val_path)


def test_sampler_and_sources_must_agree(sharded, tokenizer) -> None:
    run = packed_data(
        recipe(sharded, tokenizer), open_datasets(recipe(sharded, tokenizer), True, print)
    )
    with pytest.raises(ValueError, match="sampler covers"):
        DataLoader(run.train, MixtureSampler([3], [1.0], 4, 0), dp_rank=0, dp_size=1, micro_batch=2)
