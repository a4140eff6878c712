"""parallel.offload=params: validated against the layout, and planned as device memory that
falls by the sharded model states while host memory rises by as much."""

from __future__ import annotations

import pytest

from pretrain.launcher.plan.memory_fit import predict
from pretrain.launcher.validate.recipe import validate
from pretrain.models.flops import count_params
from tests.helpers import configure, problems


def test_offload_needs_fsdp_shards() -> None:
    (problem,) = problems(configure({"parallel.zero": 1, "parallel.offload": "params"}))
    assert problem.field == "parallel.offload"
    assert "offloads the shards of ZeRO-2/3 (FSDP2), and parallel.zero=1" in problem.reason
    assert "parallel.offload=none" in problem.fix


def test_one_data_parallel_rank_offloads_its_whole_model_state() -> None:
    """With dp=1 FSDP2 holds every parameter on one rank, and offload moves them all."""
    tp8 = {"parallel.zero": 3, "parallel.tp": 8}
    validate(configure({**tp8, "parallel.offload": "params"}), for_launch=True)
    kept = predict(configure(tp8))
    offloaded = predict(configure({**tp8, "parallel.offload": "params"}))
    params = count_params(configure({}).model).total
    assert offloaded.optimizer == 0 and kept.host == 0
    # Each tp rank's FP32 eighth, its gradient and two AdamW moments, on the host.
    assert offloaded.host == pytest.approx((4 + 4 + 2 * 4 + 4) * params / 8, rel=0.05)


def test_offloaded_model_states_leave_the_device_for_the_host() -> None:
    kept = predict(configure({"parallel.zero": 3}))
    offloaded = predict(configure({"parallel.zero": 3, "parallel.offload": "params"}))
    cfg = configure({})
    states = (4 + 4 * 2) * count_params(cfg.model).total / 8  # FP32 shard + 2 AdamW moments
    assert kept.host == 0
    assert offloaded.optimizer == 0
    assert kept.params - offloaded.params == pytest.approx(4 * count_params(cfg.model).total / 8)
    assert offloaded.total < kept.total - states * 0.99
    # The host holds the shards, their gradients, the moments and the step's temporary.
    assert offloaded.host == pytest.approx(states + 2 * 4 * count_params(cfg.model).total / 8)
