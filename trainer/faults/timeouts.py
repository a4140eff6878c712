"""The timeout in force in each phase of the loop, from the longest measured time of the phase.

Start-up (rendezvous, a checkpoint's load) and the exit keep `faults.collective_timeout_s`:
nothing measured bounds them. The first steps of a job have `faults.first_step_timeout_s`
(resolved by the launcher from the plan's predicted step time); from the second step on
(the first one warms up allocators and lazy state), a training step's limit is
`faults.timeout_factor` times the longest step measured, at least `faults.timeout_floor_s`.
A save and an evaluation keep the constant until one of them was timed, then follow the
same rule; an asynchronous save keeps it throughout, since the time the loop sees is only its
blocking part and the background write may be waited for, in a collective, at the next one.
Each rank measures its own phases: the collectives of a step make the ranks' times nearly
equal, and agreeing on one figure would cost a collective per change.

A measured limit rises only when the rule's figure exceeds the one in force by a fifth, so a
run settles on a few values, each logged as it comes into force (a console line on rank 0,
`timeout_<kind>_s` and `timeout_<kind>_longest_s` in the next metrics row).
"""

from __future__ import annotations

from pretrain.core.schema import FaultConfig
from pretrain.core.timeouts import timeout_from
from pretrain.trainer.log import get_logger

KIND_OF_PHASE = {
    "training": "step",
    "metrics": "step",
    "checkpoint": "save",
    "evaluation": "evaluation",
}
"""The measured kind whose limit holds in each phase the loop tells the watchdog of; the
other phases (setup, exit) keep the constant."""

SETTLE = 1.2
"""A measured limit replaces the one in force only when it exceeds it by this factor."""


class PhaseTimeouts:
    """The limits of the loop's phases, from the longest time measured of each kind."""

    def __init__(self, faults: FaultConfig, measure_saves: bool = True) -> None:
        self.measure_saves = measure_saves
        self.factor = faults.timeout_factor
        self.floor_s = faults.timeout_floor_s
        self.constant_s = faults.collective_timeout_s
        first_s = faults.first_step_timeout_s or faults.collective_timeout_s
        self.in_force = {"step": first_s, "save": self.constant_s, "evaluation": self.constant_s}
        self.longest: dict[str, float] = {}
        self.basis: dict[str, float] = {}
        """The longest time of each kind when its limit in force was set."""
        self._warmed_up = False
        self._changed = dict(self.in_force)

    def start_line(self) -> str:
        """The limits a job starts with, and the rule that replaces them."""
        rule = (
            f"then {self.factor:g} x the longest measured step, save or evaluation "
            f"(at least {self.floor_s:g} s)"
            if self.factor
            else "throughout (faults.timeout_factor=0)"
        )
        return (
            f"timeouts: {self.constant_s:g} s for start-up, saves and evaluations, "
            f"{self.in_force['step']:g} s for the first steps; {rule}"
        )

    def limit(self, phase: str) -> float:
        """Seconds a rank may spend in `phase` (and a collective may wait in it)."""
        kind = KIND_OF_PHASE.get(phase)
        return self.constant_s if kind is None else self.in_force[kind]

    def measured(self, kind: str, seconds: float) -> None:
        """A phase of `kind` took `seconds`; the limit of `kind` follows if it must."""
        if kind == "step" and not self._warmed_up:
            self._warmed_up = True  # the job's first step is no measure of the others
            return
        if self.factor == 0 or seconds <= self.longest.get(kind, 0.0):
            return
        if kind == "save" and not self.measure_saves:
            return
        first = kind not in self.longest
        self.longest[kind] = seconds
        figure = timeout_from(seconds, self.factor, self.floor_s)
        if first or figure > SETTLE * self.in_force[kind]:
            self.in_force[kind] = figure
            self.basis[kind] = seconds
            self._changed[kind] = figure
            get_logger().info(
                "timeouts: %s %.3g s (%g x the longest %s, %.3g s; at least %g s)",
                kind, figure, self.factor, kind, seconds, self.floor_s,
            )  # fmt: skip

    def flush(self) -> dict[str, float]:
        """The limits that came into force since the last call, as metrics."""
        row = {}
        for kind, figure in self._changed.items():
            row[f"timeout_{kind}_s"] = figure
            if kind in self.basis:
                row[f"timeout_{kind}_longest_s"] = self.basis[kind]
        self._changed = {}
        return row
