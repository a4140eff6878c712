"""Which tensor-parallel layouts the trainer runs, and the message for the one it does not."""

import pytest

from pretrain.launcher.validate.recipe import check_runnable, validate
from tests.helpers import configure


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


def test_tp_with_zero1_replicas_is_runnable():
    cfg = configure({"parallel.tp": 4, "parallel.zero": 1})
    validate(cfg, for_launch=True)


def test_tp_with_ddp_replicas_is_runnable():
    """DDP over TP's DTensor weights runs on FSDP2's replicate (parallel/data_parallel.py)."""
    cfg = configure({"parallel.tp": 4, "parallel.zero": 0})
    validate(cfg, for_launch=True)
