"""A prepared dataset's manifest, read and checked into the shape the readers index.

The manifest may come from the user (`data.source` naming a prepared directory) or from a
run that crashed while a disk filled; each field the preparation, the data checks and the
ranks index is checked here, so a hand-edited or truncated one is a ReadError naming the
field, not a KeyError on a rank.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pretrain.core.inputs.reading import ReadError, integer, mapping, read_mapping
from pretrain.dataprep.token_formats import DTYPE_SIZES

MANIFEST = "manifest.json"
"""A prepared dataset's description, written last: the dataset is complete when it exists."""
MAX_MANIFEST_BYTES = 256 << 20
"""Bound of a manifest read (a few hundred bytes per shard: about a million shards)."""
_EXPECTED = "a prepared dataset's manifest.json (written by action=prepare)"
_FIX = "prepare the dataset again (delete this folder, then action=prepare)"


def _count(value: Any, path: Path, field: str) -> int:
    count = integer(value, path, field)
    if count is None or count < 0:
        raise ReadError(path, f"{field} is {value!r:.40}", f"{field} >= 0", _FIX)
    return count


def _shard(entry: Any, path: Path, at: int) -> dict[str, Any]:
    shard = mapping(entry, path, f"shards[{at}] as a mapping")
    for field in ("file", "docs"):
        if not isinstance(shard.get(field), str) or not shard[field]:
            raise ReadError(path, f"shards[{at}].{field} is missing", "a file name", _FIX)
    if shard.get("dtype") not in DTYPE_SIZES:
        found = f"shards[{at}].dtype is {shard.get('dtype')!r:.40}"
        raise ReadError(path, found, f"one of {sorted(DTYPE_SIZES)}", _FIX)
    for field in ("tokens", "documents"):
        _count(shard.get(field), path, f"shards[{at}].{field}")
    _count(shard.get("offset", 0), path, f"shards[{at}].offset")
    return shard


def read_manifest(folder: Path) -> dict[str, Any] | None:
    """A prepared dataset's manifest with its shards checked, None when it is not
    (completely) prepared; ReadError when it is there but malformed."""
    path = folder / MANIFEST
    if not path.is_file():
        return None
    manifest = read_mapping(path, _EXPECTED, MAX_MANIFEST_BYTES)
    shards = manifest.get("shards")
    if not isinstance(shards, list):
        raise ReadError(path, "no list of shards", _EXPECTED, _FIX)
    manifest["shards"] = [_shard(entry, path, at) for at, entry in enumerate(shards)]
    for field in ("tokens", "documents"):
        _count(manifest.get(field), path, field)
    for field in ("eos_id", "max_token_id", "vocab_size"):
        integer(manifest.get(field), path, field)
    return manifest
