"""Timeouts from measured times: the rule that turns a phase's longest measured time into the
collective timeout and the hang watchdog's limit, and the first step's timeout the launcher
resolves from the plan's predicted step time.

A limit of `factor` times the longest time seen leaves room for the ordinary variation of a
phase (a slower batch, a busier file system) while a hang is named in minutes, not after the
constant default; the floor keeps short phases from timing out on a pause of the machine.
"""

from __future__ import annotations

from pretrain.core.schema import FaultConfig


def timeout_from(measured_s: float, factor: float, floor_s: float) -> float:
    """The timeout for a phase whose longest measured time is `measured_s`: `factor` times
    it, at least `floor_s`."""
    return max(floor_s, factor * measured_s)


def first_step_timeout(
    faults: FaultConfig, predicted_step_s: float | None, compiled: bool
) -> float:
    """The timeout of the steps before one was measured: `faults.first_step_timeout_s` when
    set, else the rule applied to the plan's predicted step time; `collective_timeout_s` when
    the measured times are off, nothing is predicted, or compilation (never predicted) makes
    the first steps longer than the prediction."""
    if faults.first_step_timeout_s > 0:
        return faults.first_step_timeout_s
    if faults.timeout_factor == 0 or not predicted_step_s or compiled:
        return faults.collective_timeout_s
    return timeout_from(predicted_step_s, faults.timeout_factor, faults.timeout_floor_s)
