"""The batch-size ramp and the sequence-length warm-up: which global batch and seq_len each
step runs, and how many tokens and sequences the run has trained before it.

`train.batch_schedule` and `train.seq_len_schedule` are stages that each last until a number
of tokens were trained; step k runs the stages in force at the tokens trained before it
(t_k), so a stage switches at the first step that starts at or past its threshold. Between
two thresholds the global batch G and the sequence length L are constant: a phase, whose
steps each train G x L tokens. `train.global_batch` and `train.seq_len` are the last (and
largest) stage of each.

The data order is measured in full-length sequences (`train.seq_len` tokens, the order's
units): a step of short sequences takes G x L / train.seq_len of them and cuts each into
train.seq_len / L pieces, so every phase reads the same stream of sequences and a step's
place in it is a function of its index alone.

The LR schedule runs by tokens under a ramp: a step's place in it is the tokens trained
through it over a full step's (train.global_batch x train.seq_len), so schedule.warmup_steps
and decay_steps count full steps' worth of tokens. Without a ramp every step is a full one
and this is the step count itself.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from pretrain.core.schema import TrainConfig


@dataclass(frozen=True)
class Phase:
    """A stretch of steps with one global batch and one sequence length."""

    first_step: int
    """0-based index of its first step."""
    steps: int | None
    """Its steps; None for the last phase, which lasts to the end of the run."""
    tokens_before: int
    """Tokens trained before its first step."""
    units_before: int
    """Full-length sequences of the data order read before its first step."""
    global_batch: int
    seq_len: int
    full_seq_len: int
    """train.seq_len: the length of the data order's sequences."""

    @property
    def tokens_per_step(self) -> int:
        """Tokens each of its steps trains."""
        return self.global_batch * self.seq_len

    @property
    def units_per_step(self) -> int:
        """Full-length sequences of the data order each of its steps reads."""
        return self.tokens_per_step // self.full_seq_len

    @property
    def pieces(self) -> int:
        """Sequences of this phase cut from one full-length sequence."""
        return self.full_seq_len // self.seq_len

    def end_step(self) -> int | None:
        """Index of the first step after it (None: it lasts to the end of the run)."""
        return None if self.steps is None else self.first_step + self.steps


def _stage_at(tokens: int, stages: list[tuple[int, int]], full: int) -> int:
    """The value of the first stage (value, until) that `tokens` is still before, else `full`."""
    return next((value for value, until in stages if tokens < until), full)


class Ramp:
    """The phases of a run's batch and sequence-length schedules, from `train`'s fields."""

    def __init__(self, train: TrainConfig) -> None:
        """Phases of `train`'s schedules; ValueError where a phase's batch of short
        sequences is not a whole number of full-length ones (validation refuses it first)."""
        batches = [(s.global_batch, s.until_tokens) for s in train.batch_schedule]
        lengths = [(s.seq_len, s.until_tokens) for s in train.seq_len_schedule]
        self.active = bool(batches or lengths)
        self.full_batch = train.global_batch
        self.full_seq_len = train.seq_len
        thresholds = sorted({until for _, until in batches + lengths})
        phases: list[Phase] = []
        tokens = units = step = 0
        while True:
            batch = _stage_at(tokens, batches, train.global_batch)
            length = _stage_at(tokens, lengths, train.seq_len)
            if batch * length % train.seq_len:
                raise ValueError(
                    f"a step of {batch} sequences of {length} tokens is not a whole number of "
                    f"sequences of train.seq_len={train.seq_len}"
                )
            after = [t for t in thresholds if t > tokens]
            per_step = batch * length
            if per_step < 1:
                raise ValueError(f"a step of {batch} sequences of {length} tokens trains nothing")
            steps = None if not after else -(-(after[0] - tokens) // per_step)
            phase = Phase(step, steps, tokens, units, batch, length, train.seq_len)
            if phases and (phases[-1].global_batch, phases[-1].seq_len) == (batch, length):
                last = phases[-1]
                merged = None if steps is None else (last.steps or 0) + steps
                phase = Phase(
                    last.first_step, merged, last.tokens_before, last.units_before,
                    batch, length, train.seq_len,
                )  # fmt: skip
                phases[-1] = phase
            else:
                phases.append(phase)
            if steps is None:
                break
            step += steps
            tokens += steps * per_step
            units += steps * phase.units_per_step
        self.phases = phases
        self._firsts = [p.first_step for p in phases]

    def phase(self, step: int) -> Phase:
        """The phase of 0-based step `step`."""
        return self.phases[bisect.bisect_right(self._firsts, step) - 1]

    def tokens_before(self, step: int) -> int:
        """Tokens trained by the steps before 0-based step `step` (by the first `step` steps)."""
        phase = self.phase(step)
        return phase.tokens_before + (step - phase.first_step) * phase.tokens_per_step

    def units_before(self, step: int) -> int:
        """Full-length sequences of the data order read before 0-based step `step`."""
        phase = self.phase(step)
        return phase.units_before + (step - phase.first_step) * phase.units_per_step

    def step_of_unit(self, unit: int) -> int:
        """The 0-based step that reads full-length sequence `unit` of the data order."""
        starts = [p.units_before for p in self.phases]
        phase = self.phases[bisect.bisect_right(starts, unit) - 1]
        return phase.first_step + (unit - phase.units_before) // phase.units_per_step

    def first_step_at(self, tokens: int) -> int:
        """The first 0-based step that starts with at least `tokens` trained."""
        for phase in self.phases:
            end = phase.end_step()
            if end is None or self.tokens_before(end) >= tokens:
                behind = max(0, tokens - phase.tokens_before)
                return phase.first_step + -(-behind // phase.tokens_per_step)
        raise AssertionError("the last phase lasts to the end of the run")

    def full_steps(self, steps: int) -> float:
        """The tokens trained by the first `steps` steps over a full step's: the LR
        schedule's clock (equal to `steps` without a ramp)."""
        return self.tokens_before(steps) / (self.full_batch * self.full_seq_len)

    def within(self, steps: int) -> list[Phase]:
        """The phases a run of `steps` steps reaches, the last one cut at its end."""
        reached = [p for p in self.phases if p.first_step < steps]
        last = reached[-1]
        reached[-1] = Phase(
            last.first_step, steps - last.first_step, last.tokens_before, last.units_before,
            last.global_batch, last.seq_len, last.full_seq_len,
        )  # fmt: skip
        return reached
