"""Shared test settings: this checkout on every subprocess's import path, one cache for
tokenized corpora, a private temp dir, no W&B cloud, the `slow` mark on every test that
launches torchrun or needs SLURM, the one single-process reference run of the harness model
that every FP32 layout (local or on SLURM) compares against, and the gradient-norm bound
derived from it (each trained once per test session, whichever xdist worker asks first)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch.distributed as dist

from tests.distributed.harness import (
    REORDERED,
    Curve,
    grad_norm_tolerance,
    read_curve,
    trained_once,
)
from tests.helpers import made_once, pairs_corpus_and_task

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
    # Subprocesses (the CLI, torchrun's ranks, SLURM jobs) import this checkout, not
    # whichever checkout the package happens to be installed from.
    paths = [str(REPO), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))


@pytest.fixture
def single_rank_group(tmp_path: Path):
    """A one-rank gloo process group, so DTensors and collectives can exist in a unit test."""
    if dist.is_initialized():
        pytest.skip("a process group already exists in this test process")
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


# First: xdist's own hook reads the xdist_group marks (under --dist loadgroup) and must
# find the ones added here.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Each torchrun launch costs 5-9 s and a SLURM job more: `-m "not slow"` leaves them out.
    for item in items:
        in_slow_dir = any(item.path.is_relative_to(d) for d in SLOW_DIRS)
        if in_slow_dir or item.get_closest_marker("distributed"):
            item.add_marker(pytest.mark.slow)
        if item.get_closest_marker("slurm"):
            # One test cluster of two nodes: under `-n 2 --dist loadgroup` its jobs run one
            # at a time, in one worker, while the other worker runs local tests.
            item.add_marker(pytest.mark.xdist_group("slurm"))
        elif in_slow_dir:
            # A distributed module's tests share module-scoped runs (references, the run a
            # resume continues): split over two workers, each would train them again.
            item.add_marker(pytest.mark.xdist_group(item.path.stem))
    # The SLURM group first: its jobs, one at a time, overlap the other worker's tests
    # instead of running alone at the end. Then every other slow test (the launches, the
    # full-size dry runs), and the quick ones last: they fill the gaps at the end, where a
    # slow test left for last would run alone.
    items.sort(
        key=lambda item: (
            item.get_closest_marker("slurm") is None,
            item.get_closest_marker("slow") is None,
        )
    )


@pytest.fixture(scope="session")
def monitored_overrides(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """A downstream task scored and the stability monitors sampled at the harness's
    evaluation steps (4 and 8): neither changes what is trained, so the reference runs them
    and a layout can compare its task scores and monitors with the one-process ones. One
    task file for every worker, so that they share the reference."""

    def write(folder: Path) -> None:
        folder.mkdir()
        pairs_corpus_and_task(folder, pairs=12)

    task = made_once(tmp_path_factory, "task", write) / "likes.jsonl"
    return [f"eval.tasks=[{task}]", "eval.tasks_every=4", "logging.stability_every=4"]


@pytest.fixture(scope="session")
def harness_reference_dir(
    tmp_path_factory: pytest.TempPathFactory, monitored_overrides: list[str]
) -> Path:
    """The run dir of the harness model trained by one process (with its task and
    monitors, `monitored_overrides`)."""
    return trained_once(tmp_path_factory, "reference", monitored_overrides)


@pytest.fixture(scope="session")
def harness_reference(harness_reference_dir: Path) -> Curve:
    """The harness model trained by one process: the curve every FP32 layout must match."""
    return read_curve(harness_reference_dir / "metrics.jsonl")


@pytest.fixture(scope="session")
def reordered_reference_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run dir of the one-process reference trained again with its sums reordered
    (REORDERED in tests/distributed/harness.py)."""
    return trained_once(tmp_path_factory, "reordered_reference", list(REORDERED))


@pytest.fixture(scope="session", name="grad_norm_tolerance")
def derived_grad_norm_tolerance(harness_reference: Curve, reordered_reference_dir: Path) -> float:
    """The bound on every FP32 layout's gradient norm after step 1, derived from how far the
    harness reference itself moves when its sums are reordered (`grad_norm_tolerance` in
    tests/distributed/harness.py): one more one-process run per session. The harness model's
    spread stands for its variants too (experts, MLA, document masks: the same size, steps
    and kernels)."""
    reordered = read_curve(reordered_reference_dir / "metrics.jsonl")
    bound = grad_norm_tolerance(harness_reference, reordered)
    print(f"gradient-norm bound after step 1: {bound:.2e} (derived from the reordered reference)")
    return bound
