"""The plan's tensor-parallel communication per layer and step."""

import pytest

from pretrain.core.layout import resolve_degrees
from pretrain.core.precision import COMPUTE_BYTES
from pretrain.launcher.plan.comm.tp import tp_communication
from pretrain.launcher.plan.plan import make_plan, plan_to_dict
from pretrain.launcher.plan.report.render import render_plan
from tests.helpers import configure


def _comm(overrides: dict):
    cfg = configure(overrides)
    return cfg, tp_communication(cfg, resolve_degrees(cfg))


def test_no_tp_means_no_tp_communication():
    cfg, comm = _comm({"parallel.tp": 1})
    assert comm is None
    assert make_plan(cfg).tp_comm is None


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_without_sp_each_layer_all_reduces_four_activations_per_micro_batch(dtype):
    cfg, comm = _comm({"parallel.tp": 4, "precision.dtype": dtype})
    dp = 8 // 4
    activation = cfg.train.global_batch // dp * cfg.train.seq_len * cfg.model.dim
    assert comm.collectives == {"all_reduce": 4}
    assert comm.message_bytes == 4 * activation * COMPUTE_BYTES[dtype]
    assert comm.sent_bytes == comm.message_bytes * 2 * 3 / 4


def test_sp_trades_each_all_reduce_for_an_all_gather_and_a_reduce_scatter_at_equal_traffic():
    _, plain = _comm({"parallel.tp": 8})
    _, sp = _comm({"parallel.tp": 8, "parallel.sp": True})
    assert sp.collectives == {"all_gather": 4, "reduce_scatter": 4}
    assert sp.message_bytes == 2 * plain.message_bytes
    assert sp.sent_bytes == pytest.approx(plain.sent_bytes)


def test_plan_reports_tp_communication_in_table_and_json():
    plan = make_plan(configure({"parallel.tp": 2, "parallel.sp": True}))
    assert "4 all-gather + 4 reduce-scatter" in render_plan(plan)
    assert plan_to_dict(plan)["tp_comm"]["sent_bytes"] == plan.tp_comm.sent_bytes
