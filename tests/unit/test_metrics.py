"""Throughput metrics: MFU/HFU arithmetic, where the peak comes from, timing and memory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pretrain.core.model_config import ModelConfig
from pretrain.core.schema import DataConfig, HardwareConfig
from pretrain.models.flops import flops_per_token
from pretrain.trainer.observe import cpu_peak
from pretrain.trainer.observe.metrics import (
    GIB,
    PeakFlops,
    ThroughputMeter,
    peak_memory_gib,
    resolve_peak_flops,
    table_peak_flops,
)


def test_mfu_is_model_flops_per_token_times_tokens_per_s_per_device_over_peak() -> None:
    tokens_per_step, devices, peak_tflops = 2**20, 8, 989.5
    steps, elapsed, data_wait = 4, 8.0, 2.0
    model_flops, hardware_flops = 1e10, 1.25e10  # MFU 0.66, HFU 0.83: below the peak
    meter = ThroughputMeter(
        tokens_per_step=tokens_per_step,
        model_flops_per_token=model_flops,
        hardware_flops_per_token=hardware_flops,
        devices=devices,
        peak=PeakFlops(peak_tflops, "recipe"),
    )
    metrics = meter.measure(steps=steps, elapsed_s=elapsed, data_wait_s=data_wait)

    step_time = elapsed / steps
    per_device = tokens_per_step / step_time / devices
    assert metrics["step_time_s"] == pytest.approx(step_time)
    assert metrics["data_wait_s"] == pytest.approx(data_wait / steps)
    assert metrics["tokens_per_s"] == pytest.approx(tokens_per_step / step_time)
    assert metrics["tokens_per_s_per_device"] == pytest.approx(per_device)
    assert metrics["tflops_per_device"] == pytest.approx(model_flops * per_device / 1e12)
    assert metrics["mfu"] == pytest.approx(model_flops * per_device / (peak_tflops * 1e12))
    assert metrics["hfu"] == pytest.approx(hardware_flops * per_device / (peak_tflops * 1e12))


def test_recompute_raises_hfu_above_mfu_with_the_model_flops_definition() -> None:
    flops = flops_per_token(ModelConfig(), seq_len=128)
    meter = ThroughputMeter(
        tokens_per_step=16 * 128,
        model_flops_per_token=flops.train,
        hardware_flops_per_token=flops.with_recompute("full"),
        devices=2,
        peak=PeakFlops(0.05, "recipe"),
    )
    metrics = meter.measure(steps=1, elapsed_s=0.5)
    assert metrics["hfu"] / metrics["mfu"] == pytest.approx(
        flops.with_recompute("full") / flops.train
    )


def test_without_a_peak_mfu_and_hfu_are_none_but_throughput_is_reported() -> None:
    meter = ThroughputMeter(
        tokens_per_step=1000,
        model_flops_per_token=6e6,
        hardware_flops_per_token=6e6,
        devices=1,
        peak=PeakFlops(None, "unknown device X; set hardware.peak_tflops"),
    )
    metrics = meter.measure(steps=1, elapsed_s=1.0)
    assert metrics["mfu"] is None and metrics["hfu"] is None
    assert metrics["tflops_per_device"] == pytest.approx(6e6 * 1000 / 1e12)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_recipe_peak_beats_table_and_measurement(device: str) -> None:
    peak = resolve_peak_flops(torch.device(device), "bf16", HardwareConfig(peak_tflops=123.0))
    assert peak == PeakFlops(123.0, "recipe")


def test_the_cpu_peak_is_measured_once_per_machine_and_cached(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cpu_peak, "MIN_RUN_S", 0.05)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two ranks share the machine's figure
    monkeypatch.setenv("LOCAL_RANK", "0")
    ranks, threads = cpu_peak.node_threads()
    assert ranks == 2 and threads >= 1
    measured = []
    real = cpu_peak.measure_tflops
    monkeypatch.setattr(cpu_peak, "measure_tflops", lambda n: measured.append(n) or real(n))
    first = resolve_peak_flops(torch.device("cpu"), "bf16", HardwareConfig(), tmp_path)
    assert measured == [threads] and first.dtype == "fp32"
    assert first.source.startswith(f"CPU peak measured on {threads} thread(s), cached in")
    [cached] = (tmp_path / cpu_peak.CACHE_FOLDER).iterdir()
    machine = json.loads(cached.read_text())["tflops"]
    assert first.tflops == pytest.approx(machine / 2) and machine > 0
    again = resolve_peak_flops(torch.device("cpu"), "fp32", HardwareConfig(), tmp_path)
    assert again == first and measured == [threads]  # read, not timed again
    cached.write_text("[1]")  # garbled: measured anew, never a traceback
    resolve_peak_flops(torch.device("cpu"), "fp32", HardwareConfig(), tmp_path)
    assert measured == [threads, threads]


def test_known_gpu_name_gives_the_table_peak_for_the_dtype() -> None:
    hardware = pytest.importorskip("pretrain.core.hardware")
    name = "NVIDIA H100 80GB HBM3"
    key = hardware.match_device_name(name)
    assert key is not None
    expected = hardware.gpu_spec(key).peak_tflops["bf16"]
    assert table_peak_flops(name, "bf16") == PeakFlops(expected, f"table: {key} bf16")


def test_unknown_gpu_gives_no_peak_and_says_how_to_set_one() -> None:
    pytest.importorskip("pretrain.core.hardware")
    peak = table_peak_flops("Acme Tensor Blaster 9000", "bf16")
    assert peak == PeakFlops(
        None, "unknown device Acme Tensor Blaster 9000; set hardware.peak_tflops"
    )


def test_known_gpu_without_the_dtype_gives_no_peak() -> None:
    hardware = pytest.importorskip("pretrain.core.hardware")
    name = "Tesla V100-SXM2-32GB"
    key = hardware.match_device_name(name)
    if key is None or "bf16" in hardware.gpu_spec(key).peak_tflops:
        pytest.skip("the GPU table has no known device without bf16")
    peak = table_peak_flops(name, "bf16")
    assert peak.tflops is None
    assert key in peak.source and "hardware.peak_tflops" in peak.source


def test_cpu_peak_memory_is_the_process_peak_rss_in_gib() -> None:
    block = torch.ones(32 * 2**20)  # 128 MiB, written so its pages are resident
    assert peak_memory_gib(torch.device("cpu")) >= block.numel() * block.element_size() / GIB


def test_an_mfu_above_one_is_never_reported() -> None:
    """A peak below what the run reached (a CPU peak measured on a loaded machine) gives no
    figure, and says why, rather than 'MFU 109.8%'."""
    meter = ThroughputMeter(
        tokens_per_step=1000,
        model_flops_per_token=6e9,
        hardware_flops_per_token=6e9,
        devices=1,
        peak=PeakFlops(1.0, "CPU peak measured on 2 thread(s)", "fp32"),
    )
    assert meter.measure(steps=1, elapsed_s=10.0)["mfu"] == pytest.approx(0.6)
    fast = meter.measure(steps=1, elapsed_s=5.0)  # 1.2 TFLOP/s against a 1 TFLOP/s peak
    assert fast["mfu"] is None and fast["hfu"] is None
    assert "implausible" in fast["peak_source"]


def test_a_cached_cpu_peak_the_run_outpaces_is_removed_so_the_next_run_measures_again(
    tmp_path: Path,
) -> None:
    """A peak cached while other work loaded the machine stays wrong for every later run
    unless a run that goes faster than it drops the file."""
    threads = 2
    cached = cpu_peak.cache_file(tmp_path, threads)
    cached.parent.mkdir(parents=True)
    cached.write_text(json.dumps({"tflops": 1.0, "threads": threads}) + "\n")
    tflops, source, path = cpu_peak.machine_tflops(tmp_path, threads)
    assert (tflops, path) == (1.0, cached) and "cached in" in source
    meter = ThroughputMeter(
        tokens_per_step=1000,
        model_flops_per_token=6e9,
        hardware_flops_per_token=6e9,
        devices=1,
        peak=PeakFlops(tflops, source, "fp32", cache_file=path),
    )
    assert meter.measure(steps=1, elapsed_s=10.0)["mfu"] == pytest.approx(0.6)
    assert cached.exists()
    fast = meter.measure(steps=1, elapsed_s=5.0)
    assert fast["mfu"] is None and not cached.exists()
    assert "the next run measures again" in fast["peak_source"]
    assert "measures again" not in meter.measure(steps=1, elapsed_s=5.0)["peak_source"]


def test_the_default_cache_dir_follows_pretrain_cache_dir(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Every recipe, whatever its data group, and every config built in a process honour
    the variable, so a test session or a cluster's shared disk never writes the home cache."""
    monkeypatch.setenv("PRETRAIN_CACHE_DIR", str(tmp_path))
    assert DataConfig().cache_dir == str(tmp_path)
    monkeypatch.delenv("PRETRAIN_CACHE_DIR")
    assert DataConfig().cache_dir == "~/.cache/pretrain"
