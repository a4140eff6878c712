"""The launch-to-first-step breakdown: phases between the launcher's, torchrun's and the
rank's stamps, in order, and one log line."""

from __future__ import annotations

import pytest

from pretrain.trainer.observe.startup import LAUNCH_ENV, RANK_ENV, SPAWN_ENV, StartupClock


def test_phases_run_from_the_launchers_stamp_to_the_first_step(monkeypatch) -> None:
    monkeypatch.setenv(LAUNCH_ENV, "100.0")
    monkeypatch.setenv(SPAWN_ENV, "100.5")
    monkeypatch.setenv(RANK_ENV, "102.0")
    clock = StartupClock()
    for name, at in [("imports", 104.5), ("mesh", 104.75), ("first step", 105.25)]:
        clock.mark(name, at)
    assert clock.phases() == pytest.approx(
        {"launcher": 0.5, "spawn": 1.5, "imports": 2.5, "mesh": 0.25, "first step": 0.5,
         "total": 5.25}
    )  # fmt: skip
    assert clock.line() == (
        "startup: launcher 0.50 s, spawn 1.50 s, imports 2.50 s, mesh 0.25 s, "
        "first step 0.50 s; 5.25 s from launch to the first step"
    )


def test_a_rank_not_spawned_by_the_launcher_counts_from_its_own_start(monkeypatch) -> None:
    # A SLURM job inherits the submitting launcher's stamp: its queue wait is not counted.
    monkeypatch.setenv(LAUNCH_ENV, "1.0")
    monkeypatch.delenv(SPAWN_ENV, raising=False)
    monkeypatch.setenv(RANK_ENV, "10.0")
    clock = StartupClock()
    clock.mark("imports", 12.0)
    assert clock.line() == "startup: imports 2.00 s; 2.00 s from the first stamp to the first step"
