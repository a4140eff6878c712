"""Shared test settings: one cache for tokenized corpora, a private temp dir, no W&B cloud,
and the `slow` mark on every test that launches torchrun or needs SLURM."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SLOW_DIRS = (REPO / "tests" / "distributed", REPO / "tests" / "slurm")


def pytest_configure(config: pytest.Config) -> None:
    # The tokenized test corpus is built once and shared by every test and rank.
    os.environ.setdefault("PRETRAIN_CACHE_DIR", str(REPO / ".cache" / "tests"))
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_SILENT", "true")
    tmp = REPO / ".cache" / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    # torchrun leaves a folder per launch under TMPDIR; keep them out of /tmp.
    os.environ.setdefault("TMPDIR", str(tmp))
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(REPO / ".cache" / "inductor"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Each torchrun launch costs 5-9 s and a SLURM job more: `-m "not slow"` leaves them out.
    for item in items:
        in_slow_dir = any(item.path.is_relative_to(d) for d in SLOW_DIRS)
        if in_slow_dir or item.get_closest_marker("distributed"):
            item.add_marker(pytest.mark.slow)
