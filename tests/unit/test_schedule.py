"""LR schedules: factors at chosen steps from the formulas, and resumable LambdaLR state."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from pretrain.core.schema import OptimConfig, ScheduleConfig
from pretrain.trainer.optim.lr_schedule import build_lr_scheduler, lr_factor

MIN = 0.1


def factor(name: str, step: int, total: int, warmup: int = 0, decay: int = 0) -> float:
    schedule = ScheduleConfig(name=name, warmup_steps=warmup, decay_steps=decay)
    return lr_factor(step, schedule=schedule, total_steps=total, min_ratio=MIN)


@pytest.mark.parametrize("name", ["cosine", "linear", "constant", "wsd"])
def test_warmup_starts_above_zero_and_reaches_the_peak_on_its_last_step(name: str) -> None:
    assert factor(name, 0, total=100, warmup=10) == pytest.approx(1 / 10)
    assert factor(name, 4, total=100, warmup=10) == pytest.approx(5 / 10)
    assert factor(name, 9, total=100, warmup=10) == 1.0


def test_cosine_is_at_the_peak_mid_way_and_min_at_its_ends() -> None:
    warmup, total = 10, 110
    decay = total - warmup
    # Decay progress after step s is (s - warmup + 1) / decay.
    assert factor("cosine", warmup, total, warmup) == pytest.approx(
        MIN + (1 - MIN) * 0.5 * (1 + math.cos(math.pi / decay))
    )
    assert factor("cosine", warmup + decay // 2 - 1, total, warmup) == pytest.approx((1 + MIN) / 2)
    assert factor("cosine", total - 1, total, warmup) == pytest.approx(MIN)


def test_cosine_with_decay_steps_stays_at_min_after_the_decay_and_past_the_end() -> None:
    warmup, decay, total = 5, 20, 100
    assert factor("cosine", warmup + decay - 1, total, warmup, decay) == pytest.approx(MIN)
    assert factor("cosine", warmup + decay + 30, total, warmup, decay) == pytest.approx(MIN)
    assert factor("cosine", total + 50, total, warmup) == pytest.approx(MIN)


def test_linear_decays_in_equal_steps_to_min() -> None:
    warmup, total = 10, 50
    decay = total - warmup
    for step in (warmup, warmup + 7, total - 1):
        expected = 1 - (1 - MIN) * (step - warmup + 1) / decay
        assert factor("linear", step, total, warmup) == pytest.approx(expected)
    assert factor("linear", total - 1, total, warmup) == pytest.approx(MIN)


def test_constant_holds_the_peak_after_warmup() -> None:
    assert [factor("constant", s, total=20, warmup=5) for s in (5, 19, 40)] == [1.0, 1.0, 1.0]


def test_wsd_plateaus_then_cools_down_linearly_over_the_last_decay_steps() -> None:
    warmup, decay, total = 10, 30, 100
    start = total - decay
    assert factor("wsd", warmup, total, warmup, decay) == 1.0
    assert factor("wsd", start - 1, total, warmup, decay) == 1.0
    assert factor("wsd", start, total, warmup, decay) == pytest.approx(1 - (1 - MIN) / decay)
    assert factor("wsd", start + 14, total, warmup, decay) == pytest.approx(
        1 - (1 - MIN) * 15 / decay
    )
    assert factor("wsd", total - 1, total, warmup, decay) == pytest.approx(MIN)
    assert factor("wsd", total + 10, total, warmup, decay) == pytest.approx(MIN)


def test_wsd_default_cooldown_is_the_last_fifth_of_the_run() -> None:
    total = 100
    cooldown = total // 5
    assert factor("wsd", total - cooldown - 1, total, warmup=5) == 1.0
    assert factor("wsd", total - cooldown, total, warmup=5) < 1.0
    assert factor("wsd", total - 1, total, warmup=5) == pytest.approx(MIN)


def test_extending_a_wsd_run_before_its_cooldown_keeps_every_earlier_lr() -> None:
    short, long = 100, 300
    cooldown_start = short - 30
    before = [factor("wsd", s, short, warmup=10, decay=30) for s in range(cooldown_start)]
    after = [factor("wsd", s, long, warmup=10, decay=30) for s in range(cooldown_start)]
    assert before == after
    assert factor("wsd", long - 1, long, warmup=10, decay=30) == pytest.approx(MIN)


def test_unknown_schedule_is_an_error_naming_the_choices() -> None:
    with pytest.raises(ValueError, match="cosine, linear, constant, wsd"):
        factor("step", 0, total=10)


def make_scheduler(total: int) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    optim = OptimConfig(lr=2e-3, min_lr=2e-4)
    schedule = ScheduleConfig(name="wsd", warmup_steps=3, decay_steps=4)
    optimizer = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=optim.lr)
    return optimizer, build_lr_scheduler(optimizer, optim, schedule, total)


def test_scheduler_sets_peak_times_factor_with_min_ratio_from_the_config() -> None:
    optimizer, scheduler = make_scheduler(total=12)
    schedule = ScheduleConfig(name="wsd", warmup_steps=3, decay_steps=4)
    for step in range(15):
        expected = 2e-3 * lr_factor(step, schedule=schedule, total_steps=12, min_ratio=0.1)
        assert optimizer.param_groups[0]["lr"] == pytest.approx(expected)
        optimizer.step()
        scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(2e-4)


def test_scheduler_state_round_trip_continues_the_same_lrs() -> None:
    optimizer, scheduler = make_scheduler(total=12)
    for _ in range(5):
        optimizer.step()
        scheduler.step()
    state = scheduler.state_dict()
    reference = []
    for _ in range(6):
        optimizer.step()
        scheduler.step()
        reference.append(optimizer.param_groups[0]["lr"])

    resumed_optimizer, resumed = make_scheduler(total=12)
    resumed.load_state_dict(state)
    resumed_lrs = []
    for _ in range(6):
        resumed_optimizer.step()
        resumed.step()
        resumed_lrs.append(resumed_optimizer.param_groups[0]["lr"])
    assert resumed_lrs == reference


def test_resumed_scheduler_follows_the_new_run_length_not_the_saved_one() -> None:
    optimizer, scheduler = make_scheduler(total=12)
    for _ in range(8):
        optimizer.step()
        scheduler.step()
    resumed_optimizer, resumed = make_scheduler(total=40)
    resumed.load_state_dict(scheduler.state_dict())
    optimizer.step()
    scheduler.step()
    resumed_optimizer.step()
    resumed.step()
    # Step 9 is in the 12-step run's cooldown (from step 8) but on the 40-step run's plateau.
    assert resumed.last_epoch == scheduler.last_epoch == 9
    assert optimizer.param_groups[0]["lr"] < 2e-3
    assert resumed_optimizer.param_groups[0]["lr"] == pytest.approx(2e-3)
