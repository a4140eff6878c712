"""Calibrations without a job: the fields' rules, the probe the launcher asks for, and the
plan priced at a calibration's rates (tests/distributed/test_calibrate.py runs the job)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pretrain.core.calibration import (
    calibration_path,
    layout_key,
    layout_variants,
    write_calibration,
)
from pretrain.core.layout import grad_accum_steps, resolve_degrees
from pretrain.launcher.plan.calibrated import predicted_step_s, probe_spec
from pretrain.launcher.plan.comm.tp import rank_collectives
from pretrain.launcher.plan.plan import make_plan
from tests.helpers import compose_recipe, problems


def tiny(cache: Path, *overrides: str):
    return compose_recipe("tiny", [f"data.cache_dir={cache}", *overrides])


def record(tflops: float) -> dict:
    """A calibration of 2 CPU ranks: every GEMM at `tflops`, everything else fixed."""
    return {
        "measured": "2026-12-07 00:00:00",
        "world": 2,
        "device": "cpu",
        "gemm": [[1e6, tflops], [1e9, tflops]],
        "attention": [[128, 0.01]],
        "memory_gbs": 3.0,
        "loss_gbs": 1.5,
        "op_s": 1e-5,
        "links": {"intra_node_gbs": 1.0, "intra_node_latency_us": 400.0},
        "layouts": [],
    }


def test_a_layout_entry_that_sets_another_field_is_refused_by_name(tmp_path) -> None:
    cfg = tiny(tmp_path, "calibrate.layouts=['parallel.zero=3','optim.lr=1']", "calibrate.steps=0")
    found = {p.field: str(p) for p in problems(cfg)}
    assert "optim.lr=1" in found["calibrate.layouts"]
    assert "parallel." in found["calibrate.layouts"]
    assert "calibrate.steps" in found


def test_layout_entries_apply_over_the_recipe(tmp_path) -> None:
    cfg = tiny(tmp_path, "calibrate.layouts=['parallel.tp=2 parallel.sp=true']")
    (own, base), (items, variant) = layout_variants(cfg)
    assert own == [] and base is cfg and items == ["parallel.tp=2", "parallel.sp=true"]
    assert (variant.parallel.tp, variant.parallel.sp, variant.model) == (2, True, cfg.model)


def test_the_probe_measures_a_few_of_the_runs_gemms_from_smallest_to_largest(tmp_path) -> None:
    """The tiny model's blocks at micro-batch 4 x 128 tokens: the largest GEMMs are the LM
    head's (512 tokens x 128 x 4096 vocabulary) and the smallest a K/V projection's."""
    cfg = tiny(tmp_path)
    probe = probe_spec([cfg])
    flops = [m * n * k for m, n, k in probe["gemms"]]
    assert len(flops) <= 9 and flops == sorted(flops)
    assert max(flops) == 512 * 128 * 4096 and min(flops) == 512 * 64 * 128
    assert probe["loss"] == [512, 4096] and probe["elementwise"] == [512, 128, 384]


def test_a_cpu_plan_is_priced_only_at_a_calibration_and_says_where_it_is(tmp_path) -> None:
    cfg = tiny(tmp_path)
    assert make_plan(cfg).step_time_s is None
    path = calibration_path(cfg)
    write_calibration(path, record(0.05))
    plan = make_plan(cfg)
    assert plan.step_time_s is not None and plan.step_time_s > 0
    assert any(str(path) in note for note in plan.assumptions)
    # Half the GEMM rate, more than the GEMMs' share of the step added (they are most of it).
    write_calibration(path, record(0.025))
    slower = make_plan(cfg).step_time_s
    assert slower is not None and 1.3 * plan.step_time_s < slower < 2 * plan.step_time_s


def test_a_file_that_is_not_a_calibration_is_ignored(tmp_path) -> None:
    cfg = tiny(tmp_path)
    path = calibration_path(cfg)
    path.parent.mkdir(parents=True)
    path.write_text('{"gemm": []}\n')
    assert make_plan(cfg).step_time_s is None


def test_each_machine_has_its_own_calibration_under_the_cache(tmp_path) -> None:
    cfg = tiny(tmp_path)
    other = tiny(tmp_path, "cluster.omp_num_threads=2")
    assert calibration_path(cfg) != calibration_path(other)
    assert calibration_path(cfg).parent == Path(tmp_path) / "hardware"


def test_a_calibration_charges_each_dtensor_operator_and_fsdp_and_tp_collective(tmp_path) -> None:
    """The plan's CPU step (`predicted_step_s`) at a calibration that measured the host costs
    against one that did not: tp2 adds, for each of its step's 2,500 DTensor operators, the
    DTensor cost less a plain operator's, and for each TP collective the measured fixed cost
    in place of its latency per ring step; ZeRO-3 adds the FSDP cost for each of its step's
    23 FSDP collectives."""
    tp2, zero3 = (
        tiny(tmp_path, "parallel.tp=2", "parallel.sp=true"),
        tiny(tmp_path, "parallel.zero=3"),
    )
    timed = [
        {
            "overrides": [],
            "key": layout_key(tp2),
            "step_s": [1.0],
            "ops": 5000,
            "dtensor_ops": 2500,
        },
        {"overrides": [], "key": layout_key(zero3), "step_s": [1.0], "ops": 2500},
    ]
    path = calibration_path(tp2)
    steps = []
    for host in ({}, {"dtensor_op_s": 5e-5, "tp_call_s": 1e-3, "fsdp_call_s": 2e-3}):
        write_calibration(path, {**record(0.1), "layouts": timed, **host})
        steps.append([predicted_step_s(tp2), predicted_step_s(zero3)])
    degrees = resolve_degrees(tp2)
    calls = rank_collectives(tp2, degrees, tuple(range(tp2.model.n_layers)), True, True)
    latency = sum((2 if kind == "all_reduce" else 1) * 400e-6 for kind, _ in calls)
    per_step = grad_accum_steps(tp2) * (len(calls) * 1e-3 - latency)
    assert steps[1][0] - steps[0][0] == pytest.approx(2500 * (5e-5 - 1e-5) + per_step)
    assert steps[1][1] - steps[0][1] == pytest.approx(23 * 2e-3)
