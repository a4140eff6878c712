"""The one way in for the files and environment values the tool reads.

A file is opened without blocking and read only if it is a regular file (a FIFO or a
device would block for ever or never end), up to a size bound, decoded as UTF-8 and parsed
(JSON, JSON lines, or YAML with the recipe files' alias and depth limits, checked on the
parser's events so nothing is expanded). What it holds is then taken apart with the typed
accessors (`mapping`, `integer`, `number`, `text`), so that a list where a mapping was
expected, or `{"step": null}`, is a ReadError naming the file, what was expected and the
fix, never a traceback further on.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import stat
from pathlib import Path
from typing import Any, BinaryIO

import yaml

MAX_BYTES = 1 << 20
"""Default bound of a small file the tool reads whole (configs, locks, markers)."""
MAX_LOG_BYTES = 1 << 30
"""Bound of a log the tool reads whole (metrics.jsonl of a long run)."""
YAML_MAX_ALIASES = 32
"""YAML anchors plus aliases per file: recipes need few; an alias bomb needs many."""
YAML_MAX_DEPTH = 32
"""Nesting depth of a YAML file's mappings and lists (the schema is three deep)."""
MAX_ENV_CHARS = 4096
"""Longest environment value read (a path or a name; PATH_MAX is 4096)."""

_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class ReadError(ValueError):
    """A file (or environment value) that cannot be used: which, what it holds, what was
    expected and the fix."""

    def __init__(self, source: Path | str, found: str, expected: str, fix: str) -> None:
        self.source, self.found, self.expected, self.fix = str(source), found, expected, fix
        super().__init__(f"{source}: {found}; expected {expected}; {fix}")


class MissingFile(ReadError):
    """The file does not exist (a caller may take that as "none yet")."""


def _open_regular(path: Path, expected: str) -> tuple[int, os.stat_result]:
    """A descriptor of `path` opened for reading, and its status, if it is a regular file."""
    try:
        # O_NONBLOCK: opening a FIFO with no writer would block; it is refused below.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
    except FileNotFoundError:
        raise MissingFile(path, "no such file", expected, "check the path") from None
    except OSError as err:
        found = f"cannot be opened ({err.strerror})"
        raise ReadError(path, found, expected, "check the path and its permissions") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        kind = "a directory" if stat.S_ISDIR(info.st_mode) else "not a regular file"
        raise ReadError(path, kind, expected, "give the path of a regular file")
    return fd, info


def open_binary(path: Path, expected: str) -> BinaryIO:
    """A binary stream of a regular file of any size (a corpus file, a checkpoint shard),
    for readers that stream it; ReadError if it is anything else or missing."""
    fd, _ = _open_regular(Path(path), expected)
    os.set_blocking(fd, True)  # a regular file never blocks; reads then behave as usual
    return os.fdopen(fd, "rb")


def read_span(path: Path, expected: str, offset: int, length: int) -> bytes:
    """Up to `length` bytes at `offset` of a regular file of any size: the header of a
    binary file (safetensors, Megatron .idx, Parquet's magic) without reading the rest."""
    with open_binary(path, expected) as handle:
        handle.seek(offset)
        return handle.read(length)


def file_sha256(path: Path, expected: str) -> str:
    """Hex SHA-256 of a regular file of any size, read in 4 MiB blocks."""
    digest = hashlib.sha256()
    with open_binary(path, expected) as handle:
        while block := handle.read(4 << 20):
            digest.update(block)
    return digest.hexdigest()


def read_bytes(path: Path, expected: str, max_bytes: int = MAX_BYTES) -> bytes:
    """The bytes of a regular file of at most `max_bytes`; ReadError otherwise (a missing
    file included). `expected` says what the file should be ("a run's config.yaml")."""
    path = Path(path)
    fd, info = _open_regular(path, expected)
    with os.fdopen(fd, "rb") as handle:
        if info.st_size > max_bytes:
            found = f"{info.st_size:,} bytes, more than the {max_bytes:,} read"
            raise ReadError(path, found, expected, "give the file the tool wrote")
        data = handle.read(max_bytes + 1)
    if len(data) > max_bytes:
        found = f"more than the {max_bytes:,} bytes read"
        raise ReadError(path, found, expected, "give the file the tool wrote")
    return data


def read_text(path: Path, expected: str, max_bytes: int = MAX_BYTES) -> str:
    """A regular file's text: UTF-8, no NUL bytes (a binary file is refused)."""
    data = read_bytes(path, expected, max_bytes)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        found = f"not UTF-8 text (byte {err.start} is {data[err.start]:#04x})"
        raise ReadError(path, found, expected, "give the text file the tool wrote") from None
    if "\x00" in text:
        found = f"binary (a NUL byte on line {text.count(chr(10), 0, text.index(chr(0))) + 1})"
        raise ReadError(path, found, expected, "give the text file the tool wrote")
    return text


def read_json(path: Path, expected: str, max_bytes: int = MAX_BYTES) -> Any:
    """A regular file's JSON value (shape unchecked: see the accessors)."""
    text = read_text(path, expected, max_bytes)
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as err:
        found = f"not valid JSON ({str(err).splitlines()[0][:120]})"
        raise ReadError(path, found, expected, "give the file the tool wrote") from None


def read_mapping(path: Path, expected: str, max_bytes: int = MAX_BYTES) -> dict[str, Any]:
    """A regular file's JSON object (a list, text or a number there is a ReadError)."""
    return mapping(read_json(path, expected, max_bytes), path, expected)


def json_objects(
    path: Path, expected: str, max_bytes: int = MAX_LOG_BYTES
) -> tuple[list[dict[str, Any]], int]:
    """(the JSON objects of a JSON-lines file, one per line, how many lines were not one):
    a line cut off by a crash, or any other line that is not a JSON object, is skipped."""
    objects: list[dict[str, Any]] = []
    skipped = 0
    for line in read_text(path, expected, max_bytes).splitlines():
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except (ValueError, RecursionError):
            value = None
        if isinstance(value, dict):
            objects.append(value)
        else:
            skipped += 1
    return objects, skipped


def yaml_shape_problem(text: str) -> str | None:
    """Why YAML text may not be constructed (syntax, too many aliases, too deep), from the
    parser's events alone; None when it may."""
    aliases = depth = deepest = 0
    try:
        for event in yaml.parse(text, Loader=_Loader):
            if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None):
                aliases += 1
            if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
                depth += 1
                deepest = max(deepest, depth)
            elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
                depth -= 1
            if aliases > YAML_MAX_ALIASES or deepest > YAML_MAX_DEPTH:
                break
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        what = getattr(err, "problem", None) or str(err).splitlines()[0]
        return f"not valid YAML{where}: {what}"
    if aliases > YAML_MAX_ALIASES:
        return f"more than {YAML_MAX_ALIASES} YAML anchors and aliases"
    if deepest > YAML_MAX_DEPTH:
        return f"nested more than {YAML_MAX_DEPTH} levels deep"
    return None


def read_yaml(path: Path, expected: str, max_bytes: int = MAX_BYTES) -> Any:
    """A regular file's YAML value, once its events show it safe to construct."""
    text = read_text(path, expected, max_bytes)
    problem = yaml_shape_problem(text)
    if problem is not None:
        raise ReadError(path, problem, expected, "give the file the tool wrote")
    try:
        return yaml.load(text, Loader=_Loader)
    except (yaml.YAMLError, ValueError, TypeError) as err:  # e.g. a key that is a list
        found = f"cannot be read as YAML ({str(err).splitlines()[0][:120]})"
        raise ReadError(path, found, expected, "give the file the tool wrote") from None


def mapping(value: Any, source: Path | str, expected: str) -> dict[str, Any]:
    """`value` if it is a mapping with text keys (an empty file, None, is an empty one)."""
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        found = f"holds a {type(value).__name__}, not a mapping"
        raise ReadError(source, found, expected, "give the file the tool wrote")
    return value


def integer(value: Any, source: Path | str, field: str, default: int | None = None) -> int | None:
    """A whole number field (None or missing is `default`); a bool, text, a fraction, an
    infinity or NaN is a ReadError naming the field."""
    if value is None:
        return default
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        found = f"{field} is {value!r:.60}"
        raise ReadError(source, found, f"{field} as a whole number", "give the file the tool wrote")
    return value


def number(value: Any) -> float | None:
    """A finite number, or None for anything else (a missing metric, null, NaN, text)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    as_float = float(value)
    return as_float if math.isfinite(as_float) else None


def text(value: Any, default: str = "") -> str:
    """A text field, or `default` for anything that is not text."""
    return value if isinstance(value, str) else default


def env_value(environ: Any, name: str, max_chars: int = MAX_ENV_CHARS) -> str:
    """An environment value ("" when unset), bounded and without NUL or newlines."""
    value = str(environ.get(name, "") or "")
    if len(value) > max_chars:
        found = f"{len(value):,} characters, more than {max_chars:,}"
        raise ReadError(f"${name}", found, "a path or a name", f"set {name} to a shorter value")
    if any(c in value for c in "\x00\n\r"):
        found = "holds a control character"
        raise ReadError(f"${name}", found, "a path or a name", f"set {name} to a plain value")
    return value
