"""Which source each sequence of the run's data order comes from: a mixture's shares, fixed
or scheduled over the tokens trained, turned into exact counts without storing anything.

Shares. Without `data.mixture_schedule` source s's share is its weight over the sum of the
weights, throughout. With it, each phase's weights are normalized to shares, held through
the phase or (`blend`) moved linearly with the tokens to the next phase's; since a blend of
two sets of shares sums to one, every source's share is piecewise linear in the tokens. Step
k draws by the shares p_s(k) at the tokens trained before it, all in exact fractions, so no
rounding differs between machines.

Counts (the Webster order). The data order is measured in full-length sequences
(`core/data_order/ramps.py`). Let F_s(x) be source s's running total of shares over the
first x of them, x continuous (within step k each adds p_s(k)), so the totals sum to x.
Source s's j-th sequence (j = 0, 1, ...) falls due where F_s first reaches j + 1/2, and the
data order takes the sources' sequences in the order they fall due, the lower source first
on a tie. Of the first N sequences of the run, source s supplies D_s(N), the number of its
own among the N earliest due: the counts of one order's prefixes, so each only grows and
each step's batch has exactly its size, and D_s(N) stays within about a sequence of F_s(N)
(within half of one for two sources; measured in tests/unit/test_mixture_schedule.py).
D_s(N) is computed where it is needed from the due points near N alone: O(sources x
phases), at any N.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

from pretrain.core.data_order.ramps import Ramp
from pretrain.core.schema import MixturePhase

HALF = Fraction(1, 2)


def shares_of(weights: Sequence[float]) -> tuple[Fraction, ...]:
    """Weights normalized to exact shares (each weight read as its decimal text)."""
    exact = [Fraction(str(w)) for w in weights]
    total = sum(exact)
    if min(exact) < 0 or total <= 0:
        raise ValueError(f"mixture weights must be >= 0 and sum to more than 0, got {weights}")
    return tuple(w / total for w in exact)


@dataclass(frozen=True)
class Segment:
    """Shares over the tokens [start, end): `shares` at start, moving by `slope` per token."""

    start: int
    end: int | None
    shares: tuple[Fraction, ...]
    slope: tuple[Fraction, ...]


def segments(weights: Sequence[float], phases: Sequence[MixturePhase]) -> list[Segment]:
    """The shares over the tokens: `phases` (data.mixture_schedule), or `weights` throughout."""
    if not phases:
        shares = shares_of(weights)
        return [Segment(0, None, shares, tuple(Fraction(0) for _ in shares))]
    found = []
    for i, phase in enumerate(phases):
        shares = shares_of(phase.weights)
        end = phases[i + 1].from_tokens if i + 1 < len(phases) else None
        slope = tuple(Fraction(0) for _ in shares)
        if phase.blend and end is not None:
            following = shares_of(phases[i + 1].weights)
            span = end - phase.from_tokens
            slope = tuple((b - a) / span for a, b in zip(shares, following, strict=True))
        found.append(Segment(phase.from_tokens, end, shares, slope))
    return found


@dataclass(frozen=True)
class Piece:
    """Steps of one ramp phase inside one mixture segment: shares linear in the step."""

    first_step: int
    units_per_step: int
    shares: tuple[Fraction, ...]
    """At the first step."""
    step_slope: tuple[Fraction, ...]
    """Change of each share from one step to the next."""
    totals: tuple[Fraction, ...]
    """Each source's running total F_s at the first step."""

    def shares_at(self, step: int) -> list[Fraction]:
        n = step - self.first_step
        return [q + n * d for q, d in zip(self.shares, self.step_slope, strict=True)]

    def totals_at(self, step: int) -> list[Fraction]:
        """F_s before `step`: the units of each step times its shares, summed in closed form."""
        n = step - self.first_step
        u = self.units_per_step
        return [
            f + u * (n * q + d * n * (n - 1) / 2)
            for f, q, d in zip(self.totals, self.shares, self.step_slope, strict=True)
        ]


class Mixture:
    """Shares and exact counts of a run's sources, step by step."""

    def __init__(
        self, weights: Sequence[float], ramp: Ramp, phases: Sequence[MixturePhase] = ()
    ) -> None:
        """The mixture of sources weighted `weights` (or scheduled by `phases`) over the
        steps of `ramp`."""
        self.ramp = ramp
        self.segments = segments(weights, phases)
        self.sources = len(self.segments[0].shares)
        self.pieces: list[Piece] = []
        totals = tuple(Fraction(0) for _ in range(self.sources))
        for phase in ramp.phases:
            begin, stop = phase.first_step, phase.end_step()
            for seg in self.segments:
                first = max(begin, ramp.first_step_at(seg.start))
                last = stop if seg.end is None else ramp.first_step_at(seg.end)
                if stop is not None:
                    last = min(last, stop) if last is not None else stop
                if last is not None and last <= first:
                    continue
                tokens = ramp.tokens_before(first) - seg.start
                piece = Piece(
                    first,
                    phase.units_per_step,
                    tuple(q + d * tokens for q, d in zip(seg.shares, seg.slope, strict=True)),
                    tuple(d * phase.tokens_per_step for d in seg.slope),
                    totals,
                )
                self.pieces.append(piece)
                if last is not None:
                    totals = tuple(piece.totals_at(last))
        self._firsts = [p.first_step for p in self.pieces]
        self._shares: dict[int, list[Fraction]] = {}

    def _piece(self, step: int) -> Piece:
        return self.pieces[bisect.bisect_right(self._firsts, step) - 1]

    def shares(self, step: int) -> list[Fraction]:
        """Each source's share of 0-based step `step`."""
        if step not in self._shares:
            if len(self._shares) >= 64:
                self._shares.clear()  # the due points of one count lie in a few steps
            self._shares[step] = self._piece(step).shares_at(step)
        return self._shares[step]

    def totals(self, step: int) -> list[Fraction]:
        """Each source's running total of shares F_s over the sequences before `step`."""
        return self._piece(step).totals_at(step)

    def totals_at(self, position: Fraction) -> list[Fraction]:
        """F_s at a (continuous) position of the data order, in full-length sequences."""
        step = self.ramp.step_of_unit(math.floor(position))
        start = self.ramp.units_before(step)
        shares = self.shares(step)
        return [f + (position - start) * q for f, q in zip(self.totals(step), shares, strict=True)]

    def _due(
        self, source: int, value: Fraction, position: int, total: Fraction, limit: int
    ) -> Fraction | None:
        """Where source `source`'s running total, `total` at `position`, first reaches `value`
        (None: not before `limit`)."""
        x = Fraction(position)
        step = self.ramp.step_of_unit(position)
        while x <= limit:
            end = self.ramp.units_before(step + 1)
            share = self.shares(step)[source]
            gained = (end - x) * share
            if total + gained >= value:
                return x + (value - total) / share
            total += gained
            x = Fraction(end)
            step += 1
        return None

    def drawn(self, count: int) -> list[int]:
        """How many of the first `count` sequences of the data order each source supplies."""
        if self.sources == 1:
            return [count]
        # Due points at or before `low` precede every later one; those up to `high` hold
        # the rest of the first `count` (the totals' rounding is within half a sequence each).
        low, high = max(0, count - self.sources), count + self.sources
        totals = self.totals_at(Fraction(low))
        drawn = [math.floor(f + HALF) for f in totals]
        due = []
        for source, total in enumerate(totals):
            j = drawn[source]
            while (x := self._due(source, j + HALF, low, total, high)) is not None and x <= high:
                due.append((x, source))
                j += 1
        due.sort()
        for _, source in due[: count - sum(drawn)]:
            drawn[source] += 1
        return drawn

    def drawn_before(self, step: int) -> list[int]:
        """How many sequences each source supplied to the steps before 0-based `step`."""
        return self.drawn(self.ramp.units_before(step))
