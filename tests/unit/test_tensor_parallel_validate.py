"""Which tensor-parallel layouts the trainer runs, and the message for the one it does not."""

import pytest

from pretrain.launcher.validate.recipe import check_runnable, validate
from tests.helpers import configure, problems


@pytest.mark.parametrize(
    "overrides",
    [
        {"parallel.tp": 8, "parallel.sp": True},
        {"parallel.tp": 2, "parallel.zero": 3},
        {"parallel.tp": 4, "parallel.sp": True, "parallel.zero": 2, "parallel.dp_replicate": 2},
        {"parallel.tp": 8, "parallel.zero": 0},
    ],
)
def test_tensor_and_sequence_parallel_layouts_are_runnable(overrides):
    cfg = configure(overrides)
    validate(cfg, for_launch=True)
    assert check_runnable(cfg) == []


@pytest.mark.parametrize("zero", [0, 1])
def test_tp_with_ddp_or_zero1_replicas_is_refused_for_launch_only(zero):
    cfg = configure({"parallel.tp": 4, "parallel.zero": zero})
    validate(cfg, for_launch=False)
    [problem] = [p for p in problems(cfg, for_launch=True) if p.field == "parallel.zero"]
    assert problem.value == zero
    assert "tensor parallelism with DDP or ZeRO-1 data parallelism" in problem.reason
    assert "parallel.zero=2 or 3" in problem.fix
