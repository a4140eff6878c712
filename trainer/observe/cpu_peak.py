"""The CPU's peak FLOP/s, the figure a CPU run's MFU divides by: measured once per machine,
with every thread its ranks use, and cached.

The first local rank times fp32 matmuls with torch.utils.benchmark (a warm-up, then the
median of blocks of at least MIN_RUN_S) on as many threads as the node's ranks run
together, while the other ranks wait; each rank's peak is that figure over the node's ranks.
The result is kept in CACHE_DIR/hardware, keyed by the host, its CPU, the thread count and
torch's version, so later runs on the machine read it instead of timing a matmul while
their own ranks (or other work) compete for the cores.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from pathlib import Path

import torch
import torch.distributed as dist

from pretrain.core.inputs.reading import ReadError, number, read_mapping, read_text

CACHE_FOLDER = "hardware"
"""Folder under data.cache_dir that holds the measured peaks."""
MATMUL_SIZE = 1024
"""Side of the square fp32 matrices timed: large enough that threads and caches are busy."""
MIN_RUN_S = 1.0
"""Least time of each block torch.utils.benchmark times; the median of the blocks is used."""


def _cpu_model() -> str:
    try:
        info = read_text(Path("/proc/cpuinfo"), "the kernel's CPU description", 16 << 20)
    except ReadError:
        info = ""  # not Linux
    for line in info.splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def cache_file(cache_dir: Path, threads: int) -> Path:
    """Where the peak of this machine on `threads` threads is kept."""
    machine = [platform.node(), _cpu_model(), os.cpu_count(), threads, torch.__version__]
    key = hashlib.sha256(json.dumps(machine).encode()).hexdigest()[:16]
    return cache_dir / CACHE_FOLDER / f"cpu_peak-{key}.json"


def measure_tflops(threads: int) -> float:
    """fp32 matmul TFLOP/s of this machine on `threads` threads (the median of timed blocks)."""
    from torch.utils import benchmark

    a, b = torch.randn(MATMUL_SIZE, MATMUL_SIZE), torch.randn(MATMUL_SIZE, MATMUL_SIZE)
    timer = benchmark.Timer(
        stmt="torch.mm(a, b)", globals={"torch": torch, "a": a, "b": b}, num_threads=threads
    )
    timer.timeit(3)  # warm-up: the thread pool starts, the buffers are allocated
    median = timer.blocked_autorange(min_run_time=MIN_RUN_S).median
    return 2 * MATMUL_SIZE**3 / median / 1e12


def cached_tflops(path: Path) -> float | None:
    """The peak kept in `path`; None when there is none or it is not a positive number."""
    try:
        value = number(read_mapping(path, "a measured CPU peak").get("tflops"))
    except ReadError:
        return None
    return value if value is not None and value > 0 else None


def machine_tflops(cache_dir: Path | None, threads: int) -> tuple[float, str, Path | None]:
    """(this machine's peak TFLOP/s on `threads` threads, where the figure came from, the
    file it is kept in): the cached one, else measured now and cached (where the cache can
    be written; the file is None where it cannot)."""
    path = cache_file(cache_dir, threads) if cache_dir is not None else None
    if path is not None and (cached := cached_tflops(path)) is not None:
        return cached, f"CPU peak measured on {threads} thread(s), cached in {path}", path
    tflops = measure_tflops(threads)
    if path is None:
        return tflops, f"CPU peak measured on {threads} thread(s)", None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        record = {"tflops": tflops, "threads": threads, "measured": time.strftime("%F %T")}
        tmp.write_text(json.dumps(record) + "\n")
        os.replace(tmp, path)
    except OSError:
        return tflops, f"CPU peak measured on {threads} thread(s) (not cached: {path})", None
    return tflops, f"CPU peak measured on {threads} thread(s), cached in {path}", path


def node_threads() -> tuple[int, int]:
    """(this node's ranks, the threads they run together, at most the cores it may use)."""
    ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return ranks, max(1, min(ranks * torch.get_num_threads(), cores or 1))


def rank_tflops(cache_dir: Path | None) -> tuple[float, str, Path | None]:
    """(one rank's share of its node's peak, the source, the file it is cached in or None):
    the first local rank measures or reads the node's figure while the others wait
    (collective on every rank when the process group is up)."""
    ranks, threads = node_threads()
    first = int(os.environ.get("LOCAL_RANK", "0")) == 0
    tflops, source, path = machine_tflops(cache_dir, threads) if first else (0.0, "", None)
    if dist.is_available() and dist.is_initialized():
        # Every node's first rank has its node's figure: all take the largest (the nodes of
        # a job are alike), and the ranks that did not measure learn the source too.
        gathered: list[tuple[float, str, str] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (tflops, source, str(path or "")))
        tflops, source, kept = max(g for g in gathered if g is not None)
        path = Path(kept) if kept else None
    return tflops / ranks, f"{source}, shared by {ranks} rank(s)", path


def forget_cached_peak(path: Path) -> bool:
    """Remove a cached peak a run has shown to be too low (it was measured while other work
    ran), so that the next run on this machine measures again; True if a file was removed."""
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    except OSError:
        return False  # a read-only cache: the figure stays, the run still shows MFU n/a
    return True
