"""Finished work units, counted in source order, and the processes that finish them.

`Frontier` counts units as they finish, in any order, but only up to the first one not
finished yet, so the cut at max_tokens / max_bytes falls on the same unit whatever the
number of workers. One worker tokenizes in this process; N > 1 are spawned processes (each
tokenizer single-threaded, at most two units each in flight, submitted in source order),
terminated once the frontier is complete, so units past the cut leave only .tmp files.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import queue as queue_module
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pretrain.dataprep.corpus import Unit
from pretrain.dataprep.progress import Progress
from pretrain.dataprep.shards import UnitJob, init_worker, run_in_worker, tokenize_unit


def default_workers() -> int:
    """The cores this process may run on (what SLURM allocated, under SLURM)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class Frontier:
    """Finished units counted in source order, up to the cut of max_tokens / max_bytes."""

    def __init__(self, units: list[Unit], max_tokens: int, max_bytes: int) -> None:
        self.order = [u.index for u in units]
        self.records: dict[int, dict[str, Any]] = {}
        self.max_tokens, self.max_bytes = max_tokens, max_bytes
        self.position = self.tokens = self.text_bytes = 0
        self.cut = False

    def add(self, record: dict[str, Any]) -> None:
        """A finished unit (in any order); counts every unit now contiguous with the start."""
        self.records[record["unit"]["index"]] = record
        while not self.complete and self.order[self.position] in self.records:
            done = self.records[self.order[self.position]]
            self.position += 1
            self.tokens += done["tokens"]
            self.text_bytes += done["text_bytes"]
            self.cut = (0 < self.max_tokens <= self.tokens) or (
                0 < self.max_bytes <= self.text_bytes
            )

    @property
    def complete(self) -> bool:
        """Every unit the dataset needs is finished."""
        return self.cut or self.position == len(self.order)

    def kept(self) -> list[dict[str, Any]]:
        """The records of the units the dataset holds, in order."""
        return [self.records[i] for i in self.order[: self.position]]


def _stop_after(committed: int) -> None:
    stop = os.environ.get("PRETRAIN_FAULT_PREPARE_STOP")
    if stop and committed == int(stop):
        os.kill(os.getpid(), signal.SIGTERM)


def tokenize_here(
    jobs: list[UnitJob], tokenizer: Any, eos: int, frontier: Frontier, progress: Progress
) -> None:
    """Tokenize `jobs` in order in this process until the frontier is complete."""

    def counted(documents: int, tokens: int, text_bytes: int) -> None:
        progress.add(documents, tokens, text_bytes)
        progress.tick()

    # One worker is one core: the tokenizer's own thread pool stays off, as in the workers.
    with _environment(TOKENIZERS_PARALLELISM="false"):
        for committed, job in enumerate(jobs, start=1):
            if frontier.complete:
                return
            frontier.add(tokenize_unit(job, tokenizer, eos, counted))
            progress.unit_done(job.unit.input_bytes)
            _stop_after(committed)


def tokenize_in_pool(
    jobs: list[UnitJob],
    tokenizer_path: Path,
    eos: int,
    workers: int,
    frontier: Frontier,
    progress: Progress,
) -> None:
    """Spawned workers, at most 2 units each in flight, submitted in source order."""
    # multiprocessing.Pool, not concurrent.futures: at the cut (or a stop) the units still
    # running are killed at once with terminate(); an executor can only wait for them.
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    with _main_module_hidden():
        pool = ctx.Pool(workers, init_worker, (str(tokenizer_path), eos, queue))
    in_flight: list[tuple[UnitJob, Any]] = []
    todo = list(jobs)
    committed = 0
    try:
        while not frontier.complete and (todo or in_flight):
            while todo and len(in_flight) < 2 * workers:
                job = todo.pop(0)
                in_flight.append((job, pool.apply_async(run_in_worker, (job,))))
            _drain(queue, progress, timeout=0.2)
            for job, result in [pair for pair in in_flight if pair[1].ready()]:
                in_flight.remove((job, result))
                frontier.add(result.get())  # a worker's error is raised here
                progress.unit_done(job.unit.input_bytes)
                committed += 1
                _stop_after(committed)
            progress.tick()
        _drain(queue, progress, timeout=0)
    finally:
        # Units past the cut, or interrupted ones, leave only .tmp files and no marker.
        pool.terminate()
        pool.join()


@contextlib.contextmanager
def _environment(**values: str) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def _main_module_hidden() -> Iterator[None]:
    """Start spawned workers without re-importing this program's __main__.

    A spawned process imports the parent's main module first; under torchrun that is the
    trainer (torch and all), seconds per worker. The workers only run `pretrain.dataprep.shards`,
    importable by name, so the main module's name and path are hidden while they start.
    """
    main = sys.modules["__main__"]
    saved: dict[str, object] = {
        k: main.__dict__[k] for k in ("__spec__", "__file__") if k in main.__dict__
    }
    main.__dict__.pop("__file__", None)
    main.__spec__ = None
    try:
        yield
    finally:
        main.__dict__.update(saved)


def _drain(queue: Any, progress: Progress, timeout: float) -> None:
    try:
        counts = queue.get(timeout=timeout) if timeout else queue.get_nowait()
        while True:
            progress.add(*counts)
            counts = queue.get_nowait()
    except queue_module.Empty:
        return
