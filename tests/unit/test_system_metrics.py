"""Per-node system metrics: what a node's first rank samples, how often, and the names the
main rank logs them under (trainer/observe/system_metrics.py)."""

from __future__ import annotations

import math

import pytest
import torch

from pretrain.trainer.observe.system_metrics import FIELDS, NodeSampler, host_metrics


def test_a_nodes_first_rank_samples_cpu_memory_and_load_at_most_every_so_often(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("LOCAL_RANK", "0")
    sampler = NodeSampler(torch.device("cpu"), every_s=3600)
    sum(i * i for i in range(200_000))  # some CPU time between the samples
    figures = dict(zip(FIELDS, sampler.sample(), strict=True))
    assert 0 <= figures["cpu_util"] <= 100
    assert 0 < figures["mem_used_gib"] < 4096 and figures["load_1m"] >= 0
    assert all(math.isnan(figures[f]) for f in FIELDS if f.startswith("gpu_"))  # no GPU here
    assert all(math.isnan(v) for v in sampler.sample())  # not due for an hour


@pytest.mark.parametrize(("local_rank", "every_s"), [("1", 60.0), ("0", 0.0)])
def test_other_ranks_and_a_disabled_sampler_send_nothing(
    monkeypatch: pytest.MonkeyPatch, local_rank: str, every_s: float
) -> None:
    monkeypatch.setenv("LOCAL_RANK", local_rank)
    assert all(math.isnan(v) for v in NodeSampler(torch.device("cpu"), every_s).sample())


def test_each_node_is_logged_once_under_its_host_name_from_what_its_ranks_sent() -> None:
    nan = [math.nan] * len(FIELDS)
    node = [12.5, 3.25, 0.5, *[math.nan] * 4]
    hosts = ["gpu-a01.cluster", "gpu-a01.cluster", "gpu a02", "gpu a02"]
    logged = host_metrics(hosts, [node, nan, nan, [50.0, 1.0, 2.0, 90.0, 70.5, 350.0, 61.0]])
    assert logged == {
        "system/gpu-a01.cluster/cpu_util": 12.5,
        "system/gpu-a01.cluster/mem_used_gib": 3.25,
        "system/gpu-a01.cluster/load_1m": 0.5,
        "system/gpu_a02/cpu_util": 50.0,
        "system/gpu_a02/mem_used_gib": 1.0,
        "system/gpu_a02/load_1m": 2.0,
        "system/gpu_a02/gpu_util": 90.0,
        "system/gpu_a02/gpu_mem_used_gib": 70.5,
        "system/gpu_a02/gpu_power_w": 350.0,
        "system/gpu_a02/gpu_temp_c": 61.0,
    }
