"""Per-node system metrics, `system/<host>/*`, in every sink (metrics.jsonl, the console's
file, TensorBoard, W&B) without W&B's own system runs.

One process per node samples it (the node's first local rank): CPU utilisation since its
previous sample (/proc/stat), memory in use (/proc/meminfo: total less available) and the
1-minute load; on CUDA its GPU's utilisation, memory in use, power and temperature (NVML,
through torch, where it answers). The figures travel to the main rank inside the
per-rank gather the logging window already makes (faults/step_guard.py `gather_compute`):
no collective of their own. A node samples at most every `logging.system_every_s` seconds
(by its own clock; NaNs in between), so that a thousand nodes do not fill every row and
the CPU utilisation is a mean over that span.
"""

from __future__ import annotations

import math
import os
import re
import time
from pathlib import Path

import torch

from pretrain.core.hardware import GIB
from pretrain.core.inputs.reading import ReadError, read_text

FIELDS = (
    "cpu_util",
    "mem_used_gib",
    "load_1m",
    "gpu_util",
    "gpu_mem_used_gib",
    "gpu_power_w",
    "gpu_temp_c",
)
"""What each node reports, in this order; NaN where the node cannot tell."""
_HOST_CHARS = re.compile(r"[^A-Za-z0-9_.-]+")


def _cpu_times() -> tuple[int, int] | None:
    """(busy, total) jiffies of all CPUs since boot, None where /proc/stat is missing."""
    try:
        first = read_text(Path("/proc/stat"), "the kernel's CPU counters").splitlines()[0].split()
    except (ReadError, IndexError):
        return None
    ticks = [int(x) for x in first[1:]]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
    return sum(ticks) - idle, sum(ticks)


def _mem_used_gib() -> float:
    try:
        lines = read_text(Path("/proc/meminfo"), "the kernel's memory counters").splitlines()
    except ReadError:
        return math.nan
    kib = {line.split(":")[0]: int(line.split()[1]) for line in lines if line.count(" ") >= 1}
    if "MemTotal" not in kib or "MemAvailable" not in kib:
        return math.nan
    return (kib["MemTotal"] - kib["MemAvailable"]) * 1024 / GIB


def _gpu_memory_used_gib(device: torch.device) -> float:
    free, total = torch.cuda.mem_get_info(device)
    return (total - free) / GIB


def _gpu(device: torch.device) -> list[float]:
    """Utilisation %, memory in use (GiB), power (W) and temperature (C) of `device`; NaN
    for what NVML does not answer (no NVML, a CPU run)."""
    if device.type != "cuda":
        return [math.nan] * 4
    readers = (
        lambda: torch.cuda.utilization(device),
        lambda: _gpu_memory_used_gib(device),
        lambda: torch.cuda.power_draw(device) / 1000.0,  # NVML reports milliwatts
        lambda: torch.cuda.temperature(device),
    )
    values = []
    for read in readers:
        try:
            values.append(float(read()))
        except Exception:  # NVML missing or refusing: not measured
            values.append(math.nan)
    return values


class NodeSampler:
    """Samples this node's figures every `every_s` seconds when this rank is its first
    local rank (0: never); NaNs otherwise."""

    def __init__(self, device: torch.device, every_s: float) -> None:
        self.device = device
        self.every_s = every_s
        self.first_on_node = every_s > 0 and os.environ.get("LOCAL_RANK", "0") == "0"
        self._previous = _cpu_times() if self.first_on_node else None
        self._last = -math.inf

    def sample(self) -> list[float]:
        """This node's FIELDS when a sample is due (CPU utilisation since the previous one),
        else NaNs."""
        if not self.first_on_node or time.monotonic() - self._last < self.every_s:
            return [math.nan] * len(FIELDS)
        self._last = time.monotonic()
        now = _cpu_times()
        cpu = math.nan
        if now is not None and self._previous is not None and now[1] > self._previous[1]:
            cpu = 100.0 * (now[0] - self._previous[0]) / (now[1] - self._previous[1])
        self._previous = now
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else math.nan
        return [cpu, _mem_used_gib(), load, *_gpu(self.device)]


def host_metrics(hosts: list[str], per_rank: list[list[float]]) -> dict[str, float]:
    """`system/<host>/<field>` of every node that sent figures (its first rank's), from every
    rank's gathered FIELDS; hosts' names keep letters, digits, `_`, `.` and `-`."""
    found: dict[str, float] = {}
    for host, values in zip(hosts, per_rank, strict=True):
        name = _HOST_CHARS.sub("_", host) or "host"
        for field, value in zip(FIELDS, values, strict=True):
            if math.isfinite(value):
                found.setdefault(f"system/{name}/{field}", round(value, 3))
    return found
