"""A checkpoint proves it is whole: a manifest of every file's size and SHA-256, written by
rank 0 before the rename that completes it, and checked before it is loaded.

- Saving: each rank checksums the files it wrote (its DCP shards and RNG state) and rank 0
  gathers those sums, checksums the rest and writes `manifest.json` last; before a save
  the ranks agree that the file system has room for it ("needs X GiB, has Y GiB on PATH").
- Loading: every rank checks sizes, and the checksums of its share of the files; a
  checkpoint that fails (or has no meta.json) is moved aside to `step_N.corrupt`, never
  deleted, and the previous one is tried. `.tmp` folders of saves that never finished are
  removed at the next start.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from pretrain.core.hardware import GIB
from pretrain.core.inputs.reading import ReadError, file_sha256, integer, mapping, read_mapping
from pretrain.dataprep.progress import human
from pretrain.dataprep.waiting import Wait
from pretrain.trainer.log import get_logger

MANIFEST = "manifest.json"
CORRUPT_SUFFIX = ".corrupt"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_TMP_DIR = re.compile(r"^step_(\d+)\.tmp$")
MAX_MANIFEST_BYTES = 64 << 20
"""Bound of a manifest read (a line per file: a 100k-file checkpoint is about 15 MiB)."""
SPACE_MARGIN = 1.05
"""A save needs the state's bytes plus 5% (DCP metadata, pickled objects, RNG files)."""


class DiskSpaceError(OSError):
    """The file system cannot hold the next checkpoint."""


class NoUsableCheckpoint(RuntimeError):
    """Every checkpoint of the run dir failed verification or loading."""

    def __init__(self, root: Path, reasons: list[str]) -> None:
        self.fix = (
            f"they were moved aside (*{CORRUPT_SUFFIX}, kept, not deleted); run again to start "
            f"from step 0, or restore a good copy into {root}"
        )
        super().__init__(f"no checkpoint in {root} can be loaded: " + "; ".join(reasons))


def sha256(path: Path) -> str:
    """Hex SHA-256 of a checkpoint file, read in 4 MiB blocks."""
    return file_sha256(path, "a checkpoint file")


def manifest_files(path: Path) -> dict[str, dict[str, Any]]:
    """A manifest's files: name -> {size, sha256}; ReadError if it holds anything else."""
    expected = "a checkpoint manifest: files, each with a size and a sha256"
    files = mapping(read_mapping(path, expected, MAX_MANIFEST_BYTES).get("files"), path, expected)
    for name, entry in files.items():
        entry = mapping(entry, path, expected)
        integer(entry.get("size"), path, f"files.{name}.size")
        if not isinstance(entry.get("sha256"), str):
            raise ReadError(path, f"files.{name} has no sha256", expected, "save it again")
    return files


def files_of(directory: Path) -> list[str]:
    """Every file under `directory` (relative paths, sorted), the manifest excluded."""
    return sorted(
        p.relative_to(directory).as_posix()
        for p in directory.rglob("*")
        if p.is_file() and p.name != MANIFEST
    )


def own_files(directory: Path, rank: int) -> list[str]:
    """The files of a checkpoint that `rank` wrote itself: its DCP shards and its per-rank
    files (NAME/rank_R.pt)."""
    names = [p.name for p in directory.glob(f"__{rank}_*.distcp")]
    own = [p.relative_to(directory).as_posix() for p in directory.glob(f"*/rank_{rank}.pt")]
    return [*sorted(names), *sorted(own)]


def checksums(directory: Path, names: list[str]) -> dict[str, dict[str, Any]]:
    """{name: {size, sha256}} of the named files that exist."""
    entries = {}
    for name in names:
        path = directory / name
        if path.is_file():
            entries[name] = {"size": path.stat().st_size, "sha256": sha256(path)}
    return entries


def gathered_checksums(directory: Path, rank: int, world_size: int) -> dict[str, dict[str, Any]]:
    """Each rank checksums the files it wrote; rank 0 receives them all (collective)."""
    mine = checksums(directory, own_files(directory, rank))
    gathered: list[dict | None] = [None] * world_size if rank == 0 else []
    dist.gather_object(mine, gathered if rank == 0 else None, dst=0)
    return {name: entry for part in gathered if part for name, entry in part.items()}


def write_manifest(directory: Path, known: dict[str, dict[str, Any]]) -> None:
    """Write `manifest.json` listing every file of `directory`; sums in `known` (from the
    ranks that wrote them) are reused when the size still matches, the rest computed."""
    entries = {}
    for name in files_of(directory):
        size = (directory / name).stat().st_size
        entry = known.get(name)
        if entry is None or entry["size"] != size:
            entry = {"size": size, "sha256": sha256(directory / name)}
        entries[name] = entry
    text = json.dumps({"files": entries}, indent=1) + "\n"
    tmp = directory / f".{MANIFEST}.tmp"
    tmp.write_text(text)
    os.replace(tmp, directory / MANIFEST)


def size_problems(directory: Path, meta: str, dcp_metadata: str) -> tuple[list[str], list[str]]:
    """(problems, files to checksum): what a cheap look finds wrong with a checkpoint
    (missing meta.json or DCP metadata, garbled meta.json, missing or resized files)."""
    problems = []
    for required in (meta, dcp_metadata):
        if not (directory / required).is_file():
            problems.append(f"{required} is missing")
    if (directory / meta).is_file():
        try:
            read_mapping(directory / meta, "a checkpoint's meta.json")
        except ReadError as err:
            problems.append(f"{meta}: {err.found}")
    manifest_path = directory / MANIFEST
    if not manifest_path.is_file():
        return problems, []  # written before manifests existed: nothing more to compare
    try:
        listed = manifest_files(manifest_path)
    except ReadError as err:
        return [*problems, f"{MANIFEST}: {err.found}"], []
    for name, entry in sorted(listed.items()):
        path = directory / name
        if not path.is_file():
            problems.append(f"{name} is missing")
        elif path.stat().st_size != entry["size"]:
            size = path.stat().st_size
            problems.append(f"{name} is {size:,} bytes, the manifest says {entry['size']:,}")
    return problems, sorted(listed)


def checksum_problems(directory: Path, names: list[str]) -> list[str]:
    """Files among `names` whose SHA-256 differs from the manifest's."""
    if not names:
        return []
    listed = manifest_files(directory / MANIFEST)
    return [
        f"{name} does not match its checksum"
        for name in names
        if (directory / name).is_file() and sha256(directory / name) != listed[name]["sha256"]
    ]


def verify(directory: Path, meta: str, dcp_metadata: str, rank: int, world: int) -> list[str]:
    """Every problem of a checkpoint, agreed by all ranks (collective): each rank checks the
    sizes, and the checksums of every world-th file of the manifest."""
    problems, names = size_problems(directory, meta, dcp_metadata)
    if not problems and names:
        problems = checksum_problems(directory, names[rank::world])
    gathered: list[list[str] | None] = [None] * world
    dist.all_gather_object(gathered, problems)
    return sorted({p for found in gathered for p in (found or [])})


def set_aside(path: Path) -> Path:
    """Rename a bad checkpoint to step_N.corrupt (or .corrupt.2, ...); never delete it."""
    target = path.with_name(path.name + CORRUPT_SUFFIX)
    n = 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}{CORRUPT_SUFFIX}.{n}")
    os.replace(path, target)
    return target


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """Every renamed checkpoint folder under `root`, newest first, complete or not."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name))]
    return sorted(found, reverse=True)


def remove_unfinished(root: Path) -> list[Path]:
    """Remove `step_N.tmp` folders (saves that never completed); the removed paths."""
    if not root.is_dir():
        return []
    removed = [p for p in root.iterdir() if _TMP_DIR.match(p.name) and p.is_dir()]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


def state_bytes(state_dict: Any, rank: int) -> float:
    """This rank's share of the bytes a (nested) state dict takes on disk: DCP writes a
    replicated tensor once, so a plain tensor counts on rank 0 only and a DTensor's local
    shard is divided among its replicas."""
    if isinstance(state_dict, DTensor):
        local = state_dict.to_local()
        replicas = 1
        for dim, placement in enumerate(state_dict.placements):
            if placement.is_replicate():
                replicas *= state_dict.device_mesh.size(dim)
        return local.numel() * local.element_size() / replicas
    if isinstance(state_dict, torch.Tensor):
        return float(state_dict.numel() * state_dict.element_size()) if rank == 0 else 0.0
    if isinstance(state_dict, dict):
        return sum(state_bytes(v, rank) for v in state_dict.values())
    if isinstance(state_dict, (list, tuple)):
        return sum(state_bytes(v, rank) for v in state_dict)
    return 0.0


def _size_on_disk(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _collective_device() -> torch.device:
    """Where this rank's collectives take their tensors: its GPU under NCCL, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_free_space(root: Path, step: int, state_dict: Any) -> None:
    """Raise DiskSpaceError on every rank when the file system of `root` lacks room for
    the checkpoint of `step`: the larger of the newest checkpoint's size and the ranks'
    tensors added up, plus SPACE_MARGIN (collective: the ranks agree)."""
    rank, device = dist.get_rank(), _collective_device()
    needed = torch.tensor([state_bytes(state_dict, rank)], device=device)
    dist.all_reduce(needed)
    previous = step_dirs(root)
    last = _size_on_disk(previous[0][1]) if previous else 0
    total = max(needed.item(), last) * SPACE_MARGIN
    root.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(root).free
    short = torch.tensor([float(free < total)], device=device)
    dist.all_reduce(short, op=dist.ReduceOp.MAX)
    if short.item():
        raise DiskSpaceError(
            f"the checkpoint of step {step} needs {total / GIB:.3g} GiB, has "
            f"{free / GIB:.3g} GiB on {root}"
        )


def disk_full_now(root: Path, step: int, error: BaseException) -> DiskSpaceError | None:
    """A DiskSpaceError for a save that failed while its file system is full, else None."""
    try:
        usage = shutil.disk_usage(root)
    except OSError:
        return None
    if usage.free > max(usage.total // 100, 1 << 20):
        return None
    return DiskSpaceError(
        f"the checkpoint of step {step} could not be written: {root} is full "
        f"({usage.free / GIB:.3g} GiB free; {type(error).__name__}: {str(error)[:200]})"
    )


def free_failed_save(root: Path, step: int, tmp: Path, error: BaseException, rank: int) -> None:
    """A save into `tmp` that failed on a full disk: rank 0 frees what it wrote, and a
    DiskSpaceError names the disk (the caller re-raises `error` otherwise)."""
    full = disk_full_now(root, step, error)
    if full is None:
        return
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    raise full from error


def loading(step: int, path: Path) -> Wait:
    """The progress display of verifying and loading the checkpoint at `path` (its size
    counted once); lines through the trainer's logger (rank 0's)."""
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    what = f"checkpoint: loading step {step} ({human(size)}B) from {path}"
    return Wait(what, get_logger().info, announce=False)
