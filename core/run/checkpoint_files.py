"""Which checkpoints under RUN_DIR/checkpoints are complete: a torch-free rule that the
trainer (resume), the exporter and `pretrain status` share."""

from __future__ import annotations

import re
from pathlib import Path

META = "meta.json"
"""Written last into a checkpoint's folder: the step, the layout, the data position."""
DCP_METADATA = ".metadata"
"""torch.distributed.checkpoint's index of the shards."""
_STEP_DIR = re.compile(r"^step_(\d+)$")


def step_dir(root: Path, step: int) -> Path:
    """Where the complete checkpoint of `step` lives."""
    return root / f"step_{step:08d}"


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under `root`, oldest first; `.tmp` folders never count."""
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = _STEP_DIR.match(path.name)
        if match and (path / META).is_file() and (path / DCP_METADATA).is_file():
            found.append((int(match.group(1)), path))
    return sorted(found)


def find_checkpoint(root: Path, step: int | None = None) -> Path | None:
    """The newest complete checkpoint (or the one of `step`), None if there is none."""
    found = complete_checkpoints(root)
    if step is not None:
        found = [(s, p) for s, p in found if s == step]
    return found[-1][1] if found else None
