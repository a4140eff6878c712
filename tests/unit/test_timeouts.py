"""Timeouts from measured times: the rule (a factor of the longest time, a floor), the first
steps' timeout the launcher resolves from the plan, and the limit in force in each phase."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from pretrain.core.run.metric_names import flat_name, wandb_key
from pretrain.core.schema import FaultConfig
from pretrain.core.timeouts import first_step_timeout, timeout_from
from pretrain.trainer.faults.timeouts import PhaseTimeouts
from tests.helpers import pretrain_in_process

FAULTS = FaultConfig(collective_timeout_s=600.0, timeout_factor=4.0, timeout_floor_s=30.0)


def test_the_timeout_is_the_factor_times_the_measured_time_and_never_below_the_floor() -> None:
    assert timeout_from(20.0, 4.0, 30.0) == 80.0
    assert timeout_from(5.0, 4.0, 30.0) == 30.0


def test_the_first_steps_timeout_follows_the_predicted_step_unless_set_or_unpredictable() -> None:
    assert first_step_timeout(FAULTS, 12.5, compiled=False) == 50.0
    assert first_step_timeout(FAULTS, 2.0, compiled=False) == 30.0
    assert first_step_timeout(FAULTS, None, compiled=False) == 600.0
    assert first_step_timeout(FAULTS, 12.5, compiled=True) == 600.0  # compilation unpredicted
    off = FaultConfig(collective_timeout_s=600.0, timeout_factor=0.0)
    assert first_step_timeout(off, 12.5, compiled=False) == 600.0
    chosen = FaultConfig(first_step_timeout_s=90.0)
    assert first_step_timeout(chosen, 12.5, compiled=False) == 90.0


def test_the_launcher_writes_the_plans_first_step_timeout_into_the_config(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    code, _, err = pretrain_in_process(
        "--config-name", "llama3_8b", "action=script", f"run.dir={run_dir}", cwd=tmp_path
    )
    assert code == 0, err
    predicted = json.loads((run_dir / "plan.json").read_text())["step_time_s"]
    faults = OmegaConf.load(run_dir / "config.yaml")["faults"]
    assert predicted > 0
    expected = max(faults["timeout_floor_s"], faults["timeout_factor"] * predicted)
    assert faults["first_step_timeout_s"] == pytest.approx(expected)
    assert faults["first_step_timeout_s"] != faults["collective_timeout_s"]


def test_each_phase_keeps_its_limit_until_measured_then_follows_its_longest_time() -> None:
    timeouts = PhaseTimeouts(FaultConfig(**{**vars(FAULTS), "first_step_timeout_s": 200.0}))
    assert timeouts.limit("setup") == 600.0
    assert timeouts.limit("training") == timeouts.limit("metrics") == 200.0
    assert timeouts.limit("checkpoint") == timeouts.limit("evaluation") == 600.0
    assert timeouts.flush() == {
        "timeout_step_s": 200.0, "timeout_save_s": 600.0, "timeout_evaluation_s": 600.0
    }  # fmt: skip
    timeouts.measured("step", 100.0)  # the job's first step warms up: not a measure
    assert timeouts.limit("training") == 200.0 and timeouts.flush() == {}
    timeouts.measured("step", 2.0)
    assert timeouts.limit("training") == 30.0  # the floor, below the first steps' limit
    timeouts.measured("step", 10.0)
    assert timeouts.limit("training") == 40.0
    timeouts.measured("step", 11.0)  # 44 s is within a fifth of 40 s: the limit holds
    timeouts.measured("step", 3.0)  # a shorter step never lowers it
    assert timeouts.limit("training") == 40.0
    assert timeouts.flush() == {"timeout_step_s": 40.0, "timeout_step_longest_s": 10.0}
    timeouts.measured("save", 50.0)
    timeouts.measured("evaluation", 1.0)
    assert timeouts.limit("checkpoint") == 200.0 and timeouts.limit("evaluation") == 30.0
    assert timeouts.limit("exit") == 600.0  # nothing measured bounds the exit


def test_asynchronous_saves_and_a_zero_factor_keep_the_constant() -> None:
    asynchronous = PhaseTimeouts(FAULTS, measure_saves=False)
    asynchronous.measured("save", 1.0)
    assert asynchronous.limit("checkpoint") == 600.0
    constant = PhaseTimeouts(FaultConfig(collective_timeout_s=600.0, timeout_factor=0.0))
    for seconds in (1.0, 1.0):
        constant.measured("step", seconds)
    assert constant.limit("training") == 600.0


def test_the_limits_in_force_have_a_section_of_their_own_in_wandb() -> None:
    assert wandb_key("timeout_step_s") == "timeout/step_s"
    assert flat_name("timeout/save_longest_s") == "timeout_save_longest_s"
