"""Throughput metrics, defined once: tokens/s, TFLOP/s per device, MFU, HFU, peak memory.

    tokens/s per device = tokens per step / step time / devices
    MFU = model FLOPs per token x tokens/s per device / peak FLOP/s of one device
    HFU = the same with hardware FLOPs per token (model FLOPs + recomputed forward FLOPs)

FLOPs per token come from `models.flops` (the same numbers the launcher's plan prints); the
peak comes from the recipe, the GPU table or (on CPU) a short measured matmul, never a guess.
"""

from __future__ import annotations

import math
import resource
import sys
import time
from dataclasses import dataclass, field

import torch

from pretrain.core.hardware import GIB
from pretrain.core.schema import HardwareConfig


@dataclass(frozen=True)
class PeakFlops:
    """Peak dense TFLOP/s of one device for the compute dtype, and where the figure came from.

    `tflops` is None when no trustworthy figure exists; `source` then says why. `dtype` names
    the precision the figure is for (fp8 for FP8 runs; fp32 for a measured CPU matmul).
    """

    tflops: float | None
    source: str
    dtype: str = field(default="", compare=False)


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


def measure_cpu_matmul_tflops(size: int = 512, budget_s: float = 0.2) -> float:
    """TFLOP/s of fp32 (size x size) matmuls on this process's CPU threads, timed for ~budget_s."""
    a = torch.randn(size, size)
    b = torch.randn(size, size)
    torch.mm(a, b)  # first call pays for thread-pool start-up and allocation
    iters, start = 0, time.perf_counter()
    while True:
        torch.mm(a, b)
        iters += 1
        elapsed = time.perf_counter() - start
        if elapsed >= budget_s and iters >= 3:
            break
    return 2 * size**3 * iters / elapsed / 1e12


def resolve_peak_flops(device: torch.device, dtype: str, hardware: HardwareConfig) -> PeakFlops:
    """Peak TFLOP/s of one device: recipe value > GPU table (CUDA) > measured matmul (CPU)."""
    if hardware.peak_tflops > 0:
        return PeakFlops(hardware.peak_tflops, "recipe", dtype)
    if device.type == "cuda":
        return table_peak_flops(torch.cuda.get_device_name(device), dtype)
    if device.type == "cpu":
        # Whatever the run's dtype: the CPU figure is what fp32 matmuls reach here.
        return PeakFlops(measure_cpu_matmul_tflops(), "measured CPU matmul", "fp32")
    return PeakFlops(None, f"unknown device {device.type}; set hardware.peak_tflops")


@dataclass(frozen=True)
class ThroughputMeter:
    """Turns the wall time of a window of steps into throughput metrics for one configuration.

    `tokens_per_step` counts the global batch (all data-parallel ranks); `devices` is the world
    size, so per-device figures divide the whole job's work over every device.
    """

    tokens_per_step: int
    model_flops_per_token: float
    """Forward + backward FLOPs per token (`FlopsPerToken.train`): what MFU counts."""
    hardware_flops_per_token: float
    """Model FLOPs plus recomputation (`FlopsPerToken.with_recompute`): what HFU counts."""
    devices: int
    peak: PeakFlops

    def measure(
        self, steps: int, elapsed_s: float, data_wait_s: float = 0.0
    ) -> dict[str, float | None]:
        """Metrics of `steps` steps that took `elapsed_s` (of which `data_wait_s` waiting for
        data) in total; times are reported per step, mfu and hfu are None without a peak, and
        the peak they divide by is named (`peak_tflops`, `peak_dtype`, `peak_source`)."""
        step_time_s = elapsed_s / steps
        tokens_per_s = self.tokens_per_step / step_time_s
        per_device = tokens_per_s / self.devices
        model_flops = self.model_flops_per_token * per_device
        hardware_flops = self.hardware_flops_per_token * per_device
        peak = None if self.peak.tflops is None else self.peak.tflops * 1e12
        # MFU = model FLOPs per token x tokens/s per device / peak FLOP/s (HFU: hardware FLOPs).
        mfu = None if peak is None else model_flops / peak
        hfu = None if peak is None else hardware_flops / peak
        source = self.peak.source
        if hfu is not None and (hfu > 1 or not math.isfinite(hfu)):
            # Work beyond the peak means the peak is wrong (a CPU matmul timed while other
            # processes ran): no figure rather than one above 100%.
            mfu = hfu = None
            source = f"{source}: implausible, the run went faster; set hardware.peak_tflops"
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
