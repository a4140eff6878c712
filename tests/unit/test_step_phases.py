"""The step breakdown: regions timed per step, blocked time apart, W&B keys under time/."""

from __future__ import annotations

import time

import pytest
import torch

from pretrain.trainer.observe.loggers import wandb_key
from pretrain.trainer.step.phases import OFF, StepPhases


def _busy(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_regions_are_reported_per_step_and_sleeping_counts_as_blocked() -> None:
    phases = StepPhases(torch.device("cpu"))
    for _ in range(2):
        with phases.phase("forward"):
            _busy(0.02)
        with phases.phase("optimizer"):
            time.sleep(0.05)
    times = phases.take(steps=2)
    assert times["time_forward_s"] >= 0.02
    assert times["time_optimizer_s"] >= 0.05
    # The sleep is blocked time; the busy loop only as far as the machine's load
    # deschedules it, so the bound is the regions' wall time.
    regions = times["time_forward_s"] + times["time_optimizer_s"]
    assert 0.05 <= times["time_blocked_s"] <= regions
    assert phases.take(steps=1) == {}


def test_a_disabled_recorder_times_nothing() -> None:
    with OFF.phase("forward"):
        time.sleep(0.001)
    assert OFF.take(steps=1) == {}


@pytest.mark.parametrize(
    ("name", "key"),
    [("time_forward_s", "time/forward_s"), ("data_wait_s", "time/data_wait_s")],
)
def test_breakdown_goes_under_time_in_wandb(name: str, key: str) -> None:
    assert wandb_key(name) == key


def test_a_pipeline_region_reports_its_time_outside_forward_and_backward_as_bubble() -> None:
    phases = StepPhases(torch.device("cpu"))
    with phases.phase("pipeline"):
        time.sleep(0.03)  # waiting for a peer's activation
        with phases.phase("forward"):
            _busy(0.02)
        with phases.phase("backward"):
            time.sleep(0.01)  # a collective inside the backward: exposed communication
    with phases.phase("backward"):  # after the schedule: not inside it
        _busy(0.01)
    times = phases.take(steps=1)
    assert set(times) == {
        "time_forward_s", "time_backward_s", "time_bubble_s", "time_blocked_s",
    }  # fmt: skip
    assert times["time_bubble_s"] >= 0.03
    assert times["time_backward_s"] >= 0.02
    # The backward's sleep is blocked time; the bubble's wait is not (blocked time lies
    # within the forward and backward regions, which the bubble is outside of).
    regions = times["time_forward_s"] + times["time_backward_s"]
    assert 0.01 <= times["time_blocked_s"] <= regions
