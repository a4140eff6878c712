"""The spike rule, what each policy does with a bad step, the audit log and what a rollback
leaves for a resumed run (trainer/faults/policies.py, trainer/faults/step_guard.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pretrain.core.schema import FaultConfig
from pretrain.trainer.faults.policies import (
    SpikeRule,
    after_rollbacks,
    read_audit,
    write_audit,
)
from pretrain.trainer.faults.recovery import Recovery
from pretrain.trainer.faults.step_guard import StepGuard, TooManyBadSteps
from pretrain.trainer.observe.goodput import GoodputLedger
from pretrain.trainer.observe.stability import Alert


def test_no_loss_is_a_spike_until_the_window_is_full() -> None:
    rule = SpikeRule(factor=3.0, window=3)
    assert [rule.is_spike(x) for x in (1.0, 100.0, 1.0)] == [False, False, False]
    assert rule.median() == 1.0


def test_a_loss_above_k_times_the_median_is_a_spike_and_stays_out_of_the_window() -> None:
    rule = SpikeRule(factor=3.0, window=3)
    for loss in (4.0, 2.0, 3.0):
        rule.is_spike(loss)
    assert rule.is_spike(9.01) and not rule.is_spike(9.0)
    # 9.0 entered (exactly 3 x the median is no spike); the window slid past 4.0.
    assert list(rule.losses) == [2.0, 3.0, 9.0]
    assert rule.median() == 3.0


def test_the_window_is_kept_by_a_checkpoint_and_empty_for_an_older_one() -> None:
    rule = SpikeRule(factor=2.0, window=2)
    rule.is_spike(1.0)
    rule.is_spike(1.5)
    restored = SpikeRule(factor=2.0, window=2)
    restored.load_state_dict(json.loads(json.dumps(rule.state_dict())))
    assert restored.is_spike(2.6) and not restored.is_spike(2.4)
    restored.load_absent()
    assert restored.median() is None


def guard(**faults: object) -> tuple[StepGuard, list[dict]]:
    """A guard with `faults`, its audited records collected."""
    config = FaultConfig(**faults)
    g = StepGuard(config.max_bad_steps, torch.device("cpu"), config)
    records: list[dict] = []
    g.audit = records.append
    return g, records


def test_skip_drops_the_step_audits_it_and_stops_after_max_bad_steps_in_a_row() -> None:
    g, records = guard(on_spike="skip", max_bad_steps=2)
    g.trigger, g.detail = "spike", "loss 9 > 3 x 2, the median of the last 2 steps"
    assert g.record(5, bad=True) == "skip" and g.skipped == 1
    assert g.record(6, bad=False) == ""
    assert records == [{"step": 5, "trigger": "spike", "action": "skip",
                        "detail": "loss 9 > 3 x 2, the median of the last 2 steps"}]  # fmt: skip
    g.trigger, g.detail = "nan", ""
    g.record(7, bad=True)
    with pytest.raises(TooManyBadSteps, match=r"step 8: 2 consecutive steps .*max_bad_steps=2"):
        g.record(8, bad=True)


def test_halt_stops_at_the_first_bad_step_naming_the_policy_and_audits_it() -> None:
    g, records = guard(on_nan="halt")
    g.trigger = "nan"
    with pytest.raises(TooManyBadSteps, match=r"step 3: non-finite .*\(faults\.on_nan=halt\)"):
        g.record(3, bad=True)
    assert [(r["step"], r["action"]) for r in records] == [(3, "halt")]


def test_rollback_is_left_to_the_loop_which_audits_it_with_its_details() -> None:
    g, records = guard(on_nan="rollback", on_spike="halt")
    g.trigger = "nan"
    assert g.record(4, bad=True) == "rollback" and g.skipped == 0 and records == []


def test_an_alert_halts_or_is_left_to_the_loop_to_roll_back_and_none_ignores_it() -> None:
    alerts = [Alert(7, "attn_logit_max", 131.2, 100.0), Alert(7, "z_mean", float("nan"), 1e3)]
    g, records = guard(on_alert="none")
    assert g.alerted(7, alerts) == "" and g.trigger == "" and records == []
    g, records = guard(on_alert="rollback")
    assert g.alerted(7, []) == "" and g.alerted(7, alerts) == "rollback" and records == []
    assert g.trigger == "alert" and g.detail.startswith("stability/attn_logit_max = 131.2 ")
    assert "; stability/z_mean = nan is above its threshold 1000" in g.detail
    g, records = guard(on_alert="halt")
    with pytest.raises(TooManyBadSteps, match=r"step 7: stability/attn_logit_max = 131\.2 .*"
                       r"\(faults\.on_alert=halt\); stopping without saving"):  # fmt: skip
        g.alerted(7, alerts[:1])
    assert [(r["step"], r["trigger"], r["action"]) for r in records] == [(7, "alert", "halt")]


def test_a_bad_step_a_stepper_agreed_on_alone_is_taken_as_non_finite() -> None:
    g, _ = guard(on_nan="halt", on_spike="skip")  # PipeDream-2BW agrees without the guard
    with pytest.raises(TooManyBadSteps, match="on_nan=halt"):
        g.record(2, bad=True)


def test_the_audit_log_is_replaced_whole_and_read_back(tmp_path: Path) -> None:
    write_audit(tmp_path, {"step": 3, "action": "skip"})
    write_audit(tmp_path, {"step": 6, "action": "rollback"})
    assert read_audit(tmp_path) == [
        {"step": 3, "action": "skip"},
        {"step": 6, "action": "rollback"},
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["faults.jsonl"]


ROLLBACKS = [
    {"step": 3, "action": "skip"},
    {"step": 6, "action": "rollback", "to": 4, "data_position": 6, "lr_factor": 0.5,
     "lr_until": 6},
    {"step": 5, "action": "rollback", "to": 4, "data_position": 7, "lr_factor": 1.0,
     "lr_until": 0},
]  # fmt: skip


def test_a_resume_from_a_rollbacks_checkpoint_moves_the_data_as_the_last_one_did() -> None:
    after = after_rollbacks(ROLLBACKS, restored=4)
    assert after.data_position == 7
    assert (after.lr_factor, after.lr_until) == (0.5, 6)


def test_a_resume_from_a_later_checkpoint_keeps_its_own_position_and_rate() -> None:
    after = after_rollbacks(ROLLBACKS, restored=6)
    assert after.data_position is None and after.lr_until == 0


class FakeCheckpointer:
    """Restores the checkpoint of step 4, whose loader position is 4."""

    def __init__(self, loader: FakeLoader) -> None:
        self.loader = loader

    def wait(self) -> None:
        pass

    def restore(self) -> int:
        self.loader.position = 4
        return 4


class FakeLoader:
    def __init__(self, position: int) -> None:
        self.position = position

    def state_dict(self) -> dict:
        return {"step": self.position, "seed": 0}

    def load_state_dict(self, state: dict) -> None:
        self.position = state["step"]


class Events:
    def __init__(self) -> None:
        self.records: list[dict] = []

    def event(self, record: dict) -> None:
        self.records.append(record)


def test_a_rollback_moves_the_data_past_the_bad_batch_and_stops_when_it_recurs(
    tmp_path: Path,
) -> None:
    faults = FaultConfig(max_bad_steps=2, on_spike="rollback", rollback_lr_factor=0.5,
                         rollback_lr_steps=3)  # fmt: skip
    sinks = Events()
    recovery = Recovery(tmp_path, True, faults, sinks)
    g, _ = guard(on_spike="rollback")
    g.trigger, g.detail = "spike", "loss 9 > 3 x 2"
    loader = FakeLoader(position=6)
    ledger = GoodputLedger(tmp_path, is_main=False)
    for position in (6, 8):
        loader.position = position
        to = recovery.roll_back(6, g, FakeCheckpointer(loader), loader, ledger)
        assert to == 4 and loader.position == position
    assert [r["skipped_batches"] for r in read_audit(tmp_path)] == [[5, 6], [5, 8]]
    assert (recovery.lr_factor, recovery.lr_until) == (0.5, 7)
    assert [r["action"] for r in sinks.records] == ["rollback", "rollback"]
    with pytest.raises(TooManyBadSteps, match=r"rolled back to the checkpoint of step 4 2 times"):
        recovery.roll_back(6, g, FakeCheckpointer(loader), loader, ledger)
