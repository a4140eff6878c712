"""Every file the launcher and the core read goes through core/inputs/reading.py:
a walk of the code finds any other `open(`, `.read_text(`, `.read_bytes(`, `.open(`,
`json.load`, `yaml.load`-family or `OmegaConf.load` call, outside a short allow-list whose
every entry says why. Then the layer itself, on what a careless or hostile file holds."""

from __future__ import annotations

import ast
import os
import time
from pathlib import Path

import pytest

from pretrain.core.inputs.reading import (
    MissingFile,
    ReadError,
    env_value,
    integer,
    json_objects,
    mapping,
    number,
    read_text,
    read_yaml,
)

REPO = Path(__file__).resolve().parents[2]
WALKED = ("launcher", "core")
LAYER = "core/inputs/reading.py"
ALLOWED = {
    "launcher/compose/recipe_files.py": "constructs a recipe file's YAML once the core's "
    "yaml_shape_problem passed it, reporting Problems rather than one ReadError",
    "launcher/job/backends.py": "opens the launch log to append to (a writer)",
    "core/hf_llama.py": "the Hugging Face import checks (their reader is the "
    "import's own: a bounded safetensors header)",
    "core/run/run_lock.py": "reads /proc/PID/stat, which the kernel writes",
}
"""Files that may read on their own, and why."""
_YAML_LOADS = {"load", "safe_load", "full_load", "unsafe_load", "load_all", "safe_load_all"}


def direct_reads(path: Path) -> list[str]:
    """`line: call` of every read that bypasses the layer in one source file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Name) and func.id == "open":
            found.append(f"{node.lineno}: open(")
        elif isinstance(func, ast.Attribute):
            owner = func.value.id if isinstance(func.value, ast.Name) else ""
            if func.attr in ("read_text", "read_bytes") or (func.attr == "open" and owner != "os"):
                found.append(f"{node.lineno}: .{func.attr}(")
            elif (owner, func.attr) in (("json", "load"), ("OmegaConf", "load")):
                found.append(f"{node.lineno}: {owner}.{func.attr}(")
            elif owner == "yaml" and func.attr in _YAML_LOADS:
                found.append(f"{node.lineno}: yaml.{func.attr}(")
    return found


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
    )
    assert len(direct_reads(source)) == 7  # json.loads of text and os.open are not reads


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
