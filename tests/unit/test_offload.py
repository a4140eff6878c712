"""parallel.offload=params: validated against the layout, and planned as device memory that
falls by the sharded model states while host memory rises by as much."""

from __future__ import annotations

import pytest

from pretrain.launcher.plan.memory_fit import predict
from pretrain.models.flops import count_params
from tests.helpers import configure, problems


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        ({"parallel.zero": 1}, "offloads the shards of ZeRO-2/3 (FSDP2), and parallel.zero=1"),
        ({"parallel.zero": 3, "parallel.tp": 8}, "with dp=1 nothing is sharded"),
    ],
)
def test_offload_needs_fsdp_shards(overrides: dict, reason: str) -> None:
    (problem,) = problems(configure({**overrides, "parallel.offload": "params"}))
    assert problem.field == "parallel.offload"
    assert reason in problem.reason
    assert "parallel.offload=none" in problem.fix


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
