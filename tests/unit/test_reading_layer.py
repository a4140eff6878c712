"""Every file the launcher, the core, the trainer and the data preparation read goes
through core/inputs/reading.py: a walk of the code finds any other `open(`, `.read_text(`,
`.read_bytes(`, `.open(`, `json.load`, `yaml.load`-family or `OmegaConf.load` call (an
`open` for writing only is not a read), outside a short allow-list whose every entry says
why. Then the layer itself, on what a careless or hostile file holds."""

from __future__ import annotations

import ast
import hashlib
import json
import os
import struct
import time
from pathlib import Path

import pytest

from pretrain.core.hf.llama import checkpoint_problems
from pretrain.core.inputs.reading import (
    MissingFile,
    ReadError,
    env_value,
    file_sha256,
    integer,
    json_objects,
    mapping,
    number,
    open_binary,
    read_span,
    read_text,
    read_yaml,
)
from pretrain.core.model_config import ModelConfig
from pretrain.dataprep.dataset_manifest import MANIFEST, read_manifest

REPO = Path(__file__).resolve().parents[2]
WALKED = ("launcher", "core", "trainer", "dataprep")
LAYER = "core/inputs/reading.py"
ALLOWED = {
    "launcher/compose/recipe_files.py": "constructs a recipe file's YAML once the core's "
    "yaml_shape_problem passed it, reporting Problems rather than one ReadError",
    "core/run/run_lock.py": "reads /proc/PID/stat, which the kernel writes",
    "trainer/checkpoint/hf_every.py": "reorders rows in place in the safetensors files its "
    "ranks have just assembled (opened r+b, its header read back once)",
}
"""Files that may read on their own, and why."""
BINARY_READERS = {
    "trainer/data/dataset.py": "memory-maps the token shards and document indices of a "
    "dataset whose manifest the layer checked (np.memmap / np.load of .npy)",
    "dataprep/token_sources.py": "memory-maps nanoGPT and Megatron token files once their "
    "headers were read through the layer (token_formats.py)",
    "dataprep/prepare.py": "loads the .npy document index of a part this preparation wrote",
    "dataprep/corpus.py": "Parquet and save_to_disk folders through pyarrow and datasets, "
    "whose files the data checks looked at (magic, columns) through the layer",
    "dataprep/tokenizer.py": "the tokenizers library parses a tokenizer.json it names",
    "dataprep/shards.py": "each worker loads the tokenizer.json the preparation copied",
    "trainer/checkpoint/checkpointer.py": "torch.load of a rank's RNG state, a file the "
    "checkpoint's manifest sized and checksummed first",
    "trainer/checkpoint/hf_import.py": "safetensors' own reader, after the layer read each "
    "file's header (core/hf/llama.py)",
}
"""Files that read a binary format with its library's own reader, and why that may stay."""
_BINARY_CALLS = {"memmap", "fromfile", "safe_open", "ParquetFile", "load_from_disk", "from_file"}
_YAML_LOADS = {"load", "safe_load", "full_load", "unsafe_load", "load_all", "safe_load_all"}


def _writes_only(call: ast.Call, mode_at: int) -> bool:
    """Whether an open call's mode is a literal that only writes ("w", "ab", "x")."""
    mode = call.args[mode_at] if len(call.args) > mode_at else None
    mode = next((k.value for k in call.keywords if k.arg == "mode"), mode)
    if not isinstance(mode, ast.Constant) or not isinstance(mode.value, str):
        return False
    return "r" not in mode.value and "+" not in mode.value


def direct_reads(path: Path) -> list[str]:
    """`line: call` of every read that bypasses the layer in one source file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Name) and func.id == "open":
            if not _writes_only(node, 1):
                found.append(f"{node.lineno}: open(")
        elif isinstance(func, ast.Attribute):
            owner = func.value.id if isinstance(func.value, ast.Name) else ""
            if func.attr in ("read_text", "read_bytes") or (
                func.attr == "open" and owner != "os" and not _writes_only(node, 0)
            ):
                found.append(f"{node.lineno}: .{func.attr}(")
            elif (owner, func.attr) in (("json", "load"), ("OmegaConf", "load")):
                found.append(f"{node.lineno}: {owner}.{func.attr}(")
            elif owner == "yaml" and func.attr in _YAML_LOADS:
                found.append(f"{node.lineno}: yaml.{func.attr}(")
    return found


def binary_reads(path: Path) -> list[str]:
    """`line: call` of every binary-format library read (memmap, np.load, torch.load,
    safetensors, Parquet, tokenizers, datasets) in one source file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
        owner = getattr(getattr(func, "value", None), "id", "")
        if name in _BINARY_CALLS or (name == "load" and owner in ("np", "torch")):
            found.append(f"{node.lineno}: {name}(")
    return found


def test_binary_formats_are_read_only_where_listed() -> None:
    unlisted = []
    for package in WALKED:
        for path in sorted((REPO / package).rglob("*.py")):
            relative = path.relative_to(REPO).as_posix()
            if relative not in BINARY_READERS:
                unlisted += [f"{relative}:{read}" for read in binary_reads(path)]
    assert not unlisted, "list these in BINARY_READERS with a reason:\n" + "\n".join(unlisted)
    for relative in BINARY_READERS:
        assert binary_reads(REPO / relative), f"{relative} no longer reads a binary format"


def test_every_reader_goes_through_the_reading_layer() -> None:
    bypasses = []
    for package in WALKED:
        for path in sorted((REPO / package).rglob("*.py")):
            relative = path.relative_to(REPO).as_posix()
            if relative == LAYER or relative in ALLOWED:
                continue
            bypasses += [f"{relative}:{read}" for read in direct_reads(path)]
    assert not bypasses, "read through core/inputs/reading.py:\n" + "\n".join(bypasses)
    for relative in ALLOWED:  # an entry whose file reads nothing itself is stale
        assert direct_reads(REPO / relative), f"{relative} no longer needs its allowance"


def test_the_walk_finds_each_kind_of_read(tmp_path: Path) -> None:
    source = tmp_path / "planted.py"
    source.write_text(
        "import json, yaml\nfrom omegaconf import OmegaConf\n"
        "open('x')\np.read_text()\np.read_bytes()\np.open()\njson.load(f)\n"
        "yaml.safe_load(t)\nOmegaConf.load('x')\njson.loads(t)\nos.open('x', 0)\n"
        "open('x', 'wb')\np.open('a')\np.open(mode='rb+')\ngzip.open(p, 'rb')\n"
    )
    # json.loads of text, os.open and the opens that only write are not reads
    assert len(direct_reads(source)) == 9


def test_what_is_not_a_regular_file_is_refused_without_blocking(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "folder").mkdir()
    started = time.monotonic()
    for name, found in (("fifo", "not a regular file"), ("folder", "a directory")):
        with pytest.raises(ReadError, match=found):
            read_text(tmp_path / name, "a config")
    with pytest.raises(ReadError, match="not a regular file"):
        read_text(Path("/dev/zero"), "a config")  # endless: read only if regular
    assert time.monotonic() - started < 30  # a FIFO with no writer would block for ever
    with pytest.raises(MissingFile):
        read_text(tmp_path / "nowhere", "a config")


def test_size_encoding_and_yaml_limits_are_checked_before_parsing(tmp_path: Path) -> None:
    big, binary, bomb = tmp_path / "big", tmp_path / "bin", tmp_path / "bomb.yaml"
    big.write_text("x" * 2000)
    binary.write_bytes(b"a: 1\n\x00\x01")
    bomb.write_text("a: &a [1]\n" + "".join(f"k{i}: *a\n" for i in range(40)))
    with pytest.raises(ReadError, match="2,000 bytes, more than the 1,000"):
        read_text(big, "a lock", 1000)
    with pytest.raises(ReadError, match="binary"):
        read_text(binary, "a lock")
    with pytest.raises(ReadError, match="anchors and aliases"):
        read_yaml(bomb, "a config")


def test_shapes_are_checked_into_typed_values(tmp_path: Path) -> None:
    with pytest.raises(ReadError, match="holds a list, not a mapping"):
        mapping([1], "f.yaml", "a mapping")
    assert mapping(None, "f.yaml", "a mapping") == {}
    assert integer(3.0, "m", "step") == 3 and integer(None, "m", "step", 0) == 0
    for bad in (True, "3", 1e400, float("nan"), 2.5, [3]):
        with pytest.raises(ReadError, match="step"):
            integer(bad, "m", "step")
    assert [number(v) for v in (1, 2.5, None, "x", True, 1e400, float("nan"))] == [
        1.0, 2.5, None, None, None, None, None,
    ]  # fmt: skip
    rows = tmp_path / "metrics.jsonl"
    rows.write_text('{"step": 1}\n[1]\n"x"\n{"step": 2\n\n{"step": 3}\n')
    assert json_objects(rows, "metrics") == ([{"step": 1}, {"step": 3}], 3)


def test_environment_values_are_bounded() -> None:
    assert env_value({"X": "/a/b"}, "X") == "/a/b" and env_value({}, "X") == ""
    for bad in ("/x" * 3000, "a\nb", "a\x00b"):
        with pytest.raises(ReadError, match=r"\$X"):
            env_value({"X": bad}, "X")


def test_streams_spans_and_digests_refuse_what_is_not_a_regular_file(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo")
    blob = tmp_path / "blob"
    blob.write_bytes(b"PAR1" + bytes(range(256)) * 8)
    assert read_span(blob, "a Parquet file", 0, 4) == b"PAR1"
    assert read_span(blob, "a Parquet file", 4, 3) == bytes([0, 1, 2])
    assert file_sha256(blob, "a shard") == hashlib.sha256(blob.read_bytes()).hexdigest()
    with open_binary(blob, "a shard") as stream:
        assert len(stream.read()) == blob.stat().st_size
    for reader in (
        lambda p: open_binary(p, "a shard"),
        lambda p: read_span(p, "a shard", 0, 8),
        lambda p: file_sha256(p, "a shard"),
    ):
        with pytest.raises(ReadError, match="not a regular file"):
            reader(tmp_path / "fifo")


def test_a_prepared_datasets_manifest_is_checked_field_by_field(tmp_path: Path) -> None:
    shard = {"file": "a.bin", "docs": "a.docs.npy", "dtype": "uint16", "tokens": 4}
    good = {"tokens": 4, "documents": 1, "shards": [{**shard, "documents": 1}]}
    (tmp_path / MANIFEST).write_text(json.dumps(good))
    assert read_manifest(tmp_path)["shards"][0]["file"] == "a.bin"
    assert read_manifest(tmp_path / "nowhere") is None
    for bad, named in (
        ([good], "not a mapping"),
        ({**good, "shards": {}}, "no list of shards"),
        ({**good, "shards": [{**shard, "documents": 1, "dtype": "object"}]}, "dtype"),
        ({**good, "shards": [shard]}, r"shards\[0\].documents"),
        ({**good, "shards": [{**shard, "documents": -1}]}, r"shards\[0\].documents"),
        ({**good, "tokens": "4"}, "tokens"),
        ({**good, "eos_id": 1.5}, "eos_id"),
    ):
        (tmp_path / MANIFEST).write_text(json.dumps(bad))
        with pytest.raises(ReadError, match=named):
            read_manifest(tmp_path)


def test_a_hugging_face_folder_with_garbled_files_is_a_problem_not_a_traceback(
    tmp_path: Path,
) -> None:
    model = ModelConfig(dim=64, n_layers=2, n_heads=4, vocab_size=512)
    assert "config.json" in checkpoint_problems(tmp_path, model)[0]
    (tmp_path / "config.json").write_text("[1, 2]")
    assert "holds a list, not a mapping" in checkpoint_problems(tmp_path, model)[0]
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", 3) + b"[1]")
    assert "holds a list, not a mapping" in checkpoint_problems(tmp_path, model)[-1]
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", 2) + b'{"')
    assert "not a safetensors file" in checkpoint_problems(tmp_path, model)[-1]
    header = json.dumps({"model.embed_tokens.weight": {"shape": "big"}}).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    assert "has no shape" in checkpoint_problems(tmp_path, model)[-1]
