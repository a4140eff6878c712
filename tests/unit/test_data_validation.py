"""Bad data, tokenizers, mixtures, validation and init settings are refused before any job
starts, each naming the field, the file, why and what would fit."""

from __future__ import annotations

import json
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest

from pretrain.core.problems import RecipeError
from pretrain.core.schema import SourceConfig
from pretrain.dataprep.prepare import prepare_data
from pretrain.launcher.validate.data import unprepared_problems
from pretrain.launcher.validate.recipe import validate
from tests.helpers import (
    configure,
    data_recipe,
    generated_documents,
    write_jsonl,
    write_megatron,
    write_tokenizer,
)

DOCS = generated_documents(30, seed=7)


def problems_of(overrides: dict, for_launch: bool = True) -> dict[str, list[str]]:
    """field -> every problem reported for it (the base recipe on a local cluster)."""
    cfg = configure({"cluster.backend": "local", **overrides})
    try:
        validate(cfg, for_launch=for_launch)
    except RecipeError as err:
        found: dict[str, list[str]] = {}
        for p in err.problems:
            found.setdefault(p.field, []).append(str(p))
        return found
    return {}


def only(found: dict[str, list[str]], field: str) -> str:
    assert field in found, f"no problem for {field}: {found}"
    return " | ".join(found[field])


def _write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def _empty_dir(folder: Path) -> Path:
    (folder / "README.md").parent.mkdir(parents=True)
    (folder / "README.md").write_text("no data here")
    return folder


BAD_SOURCES = {
    "missing": (lambda d: d / "missing" / "*.jsonl", "no such file or directory, and no glob"),
    "empty-dir": (_empty_dir, "holds no data files"),
    "empty-file": (lambda d: _write(d / "a.jsonl", b""), "a.jsonl is empty"),
    "only-empty-files": (
        lambda d: _write(d / "x" / "a.txt", b"").parent,
        "all 1 of its data files are empty",
    ),
    "code-dir": (
        lambda d: _write(d / "pkg" / "m.py", b"x = 1\n").parent,
        "other files (.py) are read as text with data.format=text, or name them with a glob",
    ),
    "binary": (lambda d: _write(d / "b.txt", b"text\x00\x01binary"), "b.txt is binary, not UTF-8"),
    "not-parquet": (
        lambda d: _write(d / "c.parquet", b"not parquet"),
        "c.parquet is not a Parquet",
    ),
    "no-field": (
        lambda d: _write(d / "d.jsonl", b'{"body": "x"}\n'),
        "d.jsonl:1 has no field 'text'",
    ),
    "bad-gzip": (
        lambda d: _write(d / "e.jsonl.gz", b"not gzip"),
        "e.jsonl.gz cannot be decompressed",
    ),
}


@pytest.mark.parametrize("case", BAD_SOURCES)
def test_a_bad_local_source_is_refused_naming_the_file(tmp_path: Path, case: str) -> None:
    make, reason = BAD_SOURCES[case]
    source = make(tmp_path / "src")
    assert reason in only(problems_of({"data.source": str(source)}), "data.source")
    assert "data.source" not in problems_of({"data.source": str(source)}, for_launch=False)


def test_a_good_source_passes(tmp_path: Path, tokenizer: Path) -> None:
    write_jsonl(tmp_path / "a" / "x.jsonl.zst", DOCS)
    _write(tmp_path / "a" / "empty.txt", b"")  # holds no document: left out, not refused
    found = problems_of({"data.source": str(tmp_path / "a"), "data.tokenizer": str(tokenizer),
                         "model.vocab_size": 320})  # fmt: skip
    assert not {k for k in found if k.startswith(("data.", "model.vocab"))}


def test_a_vocabulary_smaller_than_the_tokenizers_ids_is_refused(tokenizer: Path) -> None:
    found = problems_of({"data.tokenizer": str(tokenizer), "model.vocab_size": 300})
    assert "smaller than the tokenizer's ids (up to 319" in only(found, "model.vocab_size")
    assert "set model.vocab_size to at least 320" in only(found, "model.vocab_size")


def test_tokenizers_that_cannot_fit_the_sources_are_refused(tmp_path: Path, tokenizer) -> None:
    np.zeros(10, dtype=np.uint16).tofile(tmp_path / "train.bin")
    found = problems_of({"data.source": str(tmp_path / "train.bin"), "data.tokenizer": "train"})
    assert "holds token ids from an existing tokenizer" in only(found, "data.tokenizer")
    found = problems_of({"data.tokenizer": "none"})
    assert "data.source is text and needs a tokenizer" in only(found, "data.tokenizer")
    found = problems_of({"data.tokenizer": str(tmp_path / "nope.json")})
    assert "no such tokenizer.json" in only(found, "data.tokenizer")


def test_a_prepared_dataset_of_another_tokenizer_is_refused(tmp_path: Path, tokenizer) -> None:
    write_jsonl(tmp_path / "corpus.jsonl", DOCS)
    cfg = data_recipe(str(tmp_path / "corpus.jsonl"), tmp_path / "cache", tokenizer)
    [(place, _)] = prepare_data(cfg, report=lambda _: None)
    other = write_tokenizer(tmp_path / "other" / "tokenizer.json", DOCS[::-1], vocab_size=300)
    common = {"data.source": str(place.folder), "model.vocab_size": 512}
    found = problems_of({**common, "data.tokenizer": str(other)})
    assert "prepared with another tokenizer than data.tokenizer" in only(found, "data.source")
    assert str(place.folder / "tokenizer.json") in only(found, "data.source")
    assert "data.source" not in problems_of({**common, "data.tokenizer": str(tokenizer)})


def test_pre_tokenized_files_that_do_not_hold_what_they_claim_are_refused(tmp_path: Path) -> None:
    _write(tmp_path / "odd.bin", b"\x01\x02\x03")
    found = problems_of({"data.source": str(tmp_path / "odd.bin"), "data.tokenizer": "none"})
    assert "has 3 bytes, not a whole number of uint16 ids" in only(found, "data.source")
    (tmp_path / "n").mkdir()
    np.zeros(8, dtype=np.uint16).tofile(tmp_path / "n" / "train.bin")
    (tmp_path / "n" / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": 70000}))
    found = problems_of(
        {"data.source": str(tmp_path / "n" / "train.bin"), "data.tokenizer": "none"}
    )
    assert "smaller than the vocabulary of" in only(found, "model.vocab_size")
    (tmp_path / "n" / "meta.pkl").write_bytes(pickle.dumps(Path("/")))  # a global: refused
    found = problems_of(
        {"data.source": str(tmp_path / "n" / "train.bin"), "data.tokenizer": "none"}
    )
    assert "not a plain-data pickle" in only(found, "data.source")
    prefix = write_megatron(tmp_path / "m", [[1, 2, 3]])
    raw = Path(f"{prefix}.idx").read_bytes()
    Path(f"{prefix}.idx").write_bytes(b"NOTMAGIC!" + raw[9:])
    found = problems_of({"data.source": str(prefix), "data.tokenizer": "none"})
    assert "not a Megatron index (no MMIDIDX header)" in only(found, "data.source")
    Path(f"{prefix}.idx").write_bytes(raw[:9] + struct.pack("<Q", 2) + raw[17:])
    found = problems_of({"data.source": str(prefix), "data.tokenizer": "none"})
    assert "index version 2" in only(found, "data.source")


@pytest.mark.parametrize("weights", [[0.0, 1.0], [-1.0, 2.0], [float("nan"), 1.0]])
def test_mixture_weights_must_be_positive(weights: list[float]) -> None:
    sources = [SourceConfig("stdlib", weight=weights[0]), SourceConfig("hf:a/b", weight=weights[1])]
    found = problems_of({"data.sources": sources}, for_launch=False)
    assert "must be a positive number" in only(found, "data.sources[0].weight")


def test_a_run_needs_at_least_one_source() -> None:
    found = problems_of({"data.source": " "}, for_launch=False)
    assert "a run needs at least one source" in only(found, "data.source")


def test_mixture_items_need_a_source_a_known_format_and_distinct_labels() -> None:
    sources = [SourceConfig(""), SourceConfig("a.jsonl", format="csv"), SourceConfig("b/a.jsonl")]
    found = problems_of({"data.sources": sources}, for_launch=False)
    assert "is empty" in only(found, "data.sources[0].source")
    assert "unknown value 'csv'" in only(found, "data.sources[1].format")
    assert "label 'a' is also source 1's" in only(found, "data.sources[2].name")


@pytest.mark.parametrize(
    ("overrides", "field", "reason"),
    [
        ({"data.val_fraction": 1.0}, "data.val_fraction", "must lie in [0, 1)"),
        ({"data.val_fraction": -0.1}, "data.val_fraction", "must lie in [0, 1)"),
        ({"data.val_fraction": 0.1, "data.val_source": "v.jsonl"}, "data.val_source", "both"),
        ({"eval.every": 10}, "eval.every", "no validation split to evaluate on"),
        ({"eval.batches": 0}, "eval.batches", "must be >= 1"),
        ({"data.max_tokens": -1}, "data.max_tokens", "must be >= 0"),
        ({"data.workers": -2}, "data.workers", "must be >= 0"),
        ({"data.doc_mask": True, "data.tokenizer": "none"}, "data.doc_mask", "has none"),
    ],
)
def test_bad_split_eval_and_worker_settings_are_refused(overrides, field, reason) -> None:
    assert reason in only(problems_of(overrides), field)


def test_a_cache_dir_that_is_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    found = problems_of({"data.cache_dir": str(tmp_path / "file" / "cache")})
    assert "is a file, not a directory" in only(found, "data.cache_dir")


def test_a_slurm_run_of_unprepared_data_is_refused_with_the_command(tmp_path: Path) -> None:
    cfg = configure({"cluster.backend": "slurm", "data.cache_dir": str(tmp_path)})
    [problem] = unprepared_problems(cfg)
    assert problem.field == "data.source" and "not prepared" in problem.reason
    assert "action=prepare" in problem.fix
    cfg.data.source = str(tmp_path / "not-here.jsonl")
    [problem] = unprepared_problems(cfg)
    assert "cannot be found from here" in problem.reason


def test_a_hugging_face_checkpoint_of_another_shape_is_refused_naming_the_tensor(
    tmp_path: Path,
) -> None:
    from safetensors.numpy import save_file

    from pretrain.core.hf.llama import config_json, expected_shapes, hf_name

    cfg = configure({})
    tensors = {hf_name(n): np.zeros(s, np.float32) for n, s in expected_shapes(cfg.model).items()}
    tensors["model.layers.3.mlp.up_proj.weight"] = np.zeros((7, cfg.model.dim), np.float32)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(config_json(cfg.model, 0)))
    found = problems_of({"init.from_hf": str(tmp_path)})
    assert (
        f"model.layers.3.mlp.up_proj.weight is [7, {cfg.model.dim}] there, "
        f"layers.3.feed_forward.w3.weight is [{cfg.model.ffn_dim}, {cfg.model.dim}] here"
    ) in only(found, "init.from_hf")
    config = config_json(cfg.model, 0) | {"hidden_size": 64, "rope_scaling": {"type": "llama3"}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    problems = only(problems_of({"init.from_hf": str(tmp_path)}), "init.from_hf")
    assert f"hidden_size=64 there, model.dim={cfg.model.dim} here" in problems
    assert "rope scaling" in problems
    found = problems_of({"init.from_hf": str(tmp_path / "nowhere")})
    assert "no such directory" in only(found, "init.from_hf")
    found = problems_of({"init.from_hf": str(tmp_path), "model.moe_experts": 4})
    assert "model_type 'llama' there, 'mixtral' here" in only(found, "init.from_hf")
