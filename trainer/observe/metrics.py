"""Throughput metrics, defined once: tokens/s, TFLOP/s per device, MFU, HFU, peak memory.

    tokens/s per device = tokens per step / step time / devices
    MFU = model FLOPs per token x tokens/s per device / peak FLOP/s of one device
    HFU = the same with hardware FLOPs per token (model FLOPs + recomputed forward FLOPs)

FLOPs per token come from `models.flops` (the same numbers the launcher's plan prints); the
peak comes from the recipe, the GPU table or (on CPU) the machine's measured peak
(`cpu_peak.py`: once per machine, all its ranks' threads, cached), never a guess.
"""

from __future__ import annotations

import math
import resource
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pretrain.core.hardware import GIB
from pretrain.core.schema import HardwareConfig
from pretrain.trainer.observe.cpu_peak import forget_cached_peak, rank_tflops


@dataclass(frozen=True)
class PeakFlops:
    """Peak dense TFLOP/s of one device for the compute dtype, and where the figure came from.

    `tflops` is None when no trustworthy figure exists; `source` then says why. `dtype` names
    the precision the figure is for (fp8 for FP8 runs; fp32 for a measured CPU peak).
    """

    tflops: float | None
    source: str
    dtype: str = field(default="", compare=False)
    cache_file: Path | None = field(default=None, compare=False)
    """The file a measured CPU peak was read from or written to; None for any other peak."""


def table_peak_flops(device_name: str, dtype: str) -> PeakFlops:
    """Peak of a CUDA device from the GPU table, looked up by its reported name and the dtype."""
    from pretrain.core.hardware import gpu_spec, match_device_name

    key = match_device_name(device_name)
    if key is None:
        return PeakFlops(None, f"unknown device {device_name}; set hardware.peak_tflops")
    tflops = gpu_spec(key).peak_tflops.get(dtype)
    if tflops is None:
        return PeakFlops(None, f"no {dtype} peak for {key} in the table; set hardware.peak_tflops")
    return PeakFlops(tflops, f"table: {key} {dtype}", dtype)


def resolve_peak_flops(
    device: torch.device, dtype: str, hardware: HardwareConfig, cache_dir: Path | None = None
) -> PeakFlops:
    """Peak TFLOP/s of one device: recipe value > GPU table (CUDA) > this machine's measured
    CPU peak, cached under `cache_dir` (CPU; collective when the process group is up)."""
    if hardware.peak_tflops > 0:
        return PeakFlops(hardware.peak_tflops, "recipe", dtype)
    if device.type == "cuda":
        return table_peak_flops(torch.cuda.get_device_name(device), dtype)
    if device.type == "cpu":
        # Whatever the run's dtype: the CPU figure is what fp32 matmuls reach here.
        tflops, source, cached = rank_tflops(cache_dir)
        return PeakFlops(tflops, source, "fp32", cached)
    return PeakFlops(None, f"unknown device {device.type}; set hardware.peak_tflops")


@dataclass(frozen=True)
class ThroughputMeter:
    """Turns the wall time of a window of steps into throughput metrics for one configuration.

    `tokens_per_step` counts the global batch (all data-parallel ranks); `devices` is the world
    size, so per-device figures divide the whole job's work over every device. Under a
    batch-size ramp or sequence-length warm-up `step_work` gives each step's own tokens and
    FLOPs, so a window's MFU is that of the stage it ran.
    """

    tokens_per_step: int
    model_flops_per_token: float
    """Forward + backward FLOPs per token (`FlopsPerToken.train`): what MFU counts."""
    hardware_flops_per_token: float
    """Model FLOPs plus recomputation (`FlopsPerToken.with_recompute`): what HFU counts."""
    devices: int
    peak: PeakFlops
    step_work: Callable[[int], tuple[int, float, float]] | None = None
    """Tokens, model FLOPs and hardware FLOPs of 0-based step k, where steps differ."""

    def measure(
        self,
        steps: int,
        elapsed_s: float,
        data_wait_s: float = 0.0,
        last_step: int | None = None,
    ) -> dict[str, float | None]:
        """Metrics of `steps` steps that took `elapsed_s` (of which `data_wait_s` waiting for
        data) in total, the last of them the `last_step`-th; times are reported per step,
        mfu and hfu are None without a peak, and the peak they divide by is named
        (`peak_tflops`, `peak_dtype`, `peak_source`)."""
        step_time_s = elapsed_s / steps
        tokens_per_s = self.tokens_per_step / step_time_s
        per_device = tokens_per_s / self.devices
        model_flops = self.model_flops_per_token * per_device
        hardware_flops = self.hardware_flops_per_token * per_device
        if self.step_work is not None and last_step is not None:
            work = [self.step_work(k) for k in range(last_step - steps, last_step)]
            tokens_per_s = sum(w[0] for w in work) / elapsed_s
            per_device = tokens_per_s / self.devices
            model_flops = sum(w[1] for w in work) / elapsed_s / self.devices
            hardware_flops = sum(w[2] for w in work) / elapsed_s / self.devices
        peak = None if self.peak.tflops is None else self.peak.tflops * 1e12
        # MFU = model FLOPs per token x tokens/s per device / peak FLOP/s (HFU: hardware FLOPs).
        mfu = None if peak is None else model_flops / peak
        hfu = None if peak is None else hardware_flops / peak
        source = self.peak.source
        if hfu is not None and (hfu > 1 or not math.isfinite(hfu)):
            # Work beyond the peak means the peak is wrong (a CPU peak measured while other
            # work ran): no figure rather than one above 100%.
            mfu = hfu = None
            source = f"{source}: implausible, the run went faster; set hardware.peak_tflops"
            if self.peak.cache_file is not None and forget_cached_peak(self.peak.cache_file):
                source += " (the cached figure was removed: the next run measures again)"
        return {
            "tokens_per_s": tokens_per_s,
            "tokens_per_s_per_device": per_device,
            "step_time_s": step_time_s,
            "data_wait_s": data_wait_s / steps,
            "tflops_per_device": model_flops / 1e12,
            "mfu": mfu,
            "hfu": hfu,
            "peak_tflops": self.peak.tflops,
            "peak_dtype": self.peak.dtype or None,
            "peak_source": source,
        }


def peak_memory_gib(device: torch.device) -> float:
    """Peak memory in GiB: CUDA allocated by torch on `device`, or this process's peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / GIB
    # ru_maxrss is in KiB on Linux and in bytes on macOS.
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / GIB if sys.platform == "darwin" else rss * 1024 / GIB
