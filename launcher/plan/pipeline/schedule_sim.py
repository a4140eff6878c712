"""The pipeline schedule as data: per-stage timelines, bubble and in-flight micro-batches.

Pure Python (no torch), so `action=plan` can print it. A schedule is a program per pipeline
rank (the order of its forward and backward ops, the same order as the schedule IR
`pipeline_order` of the `torch.distributed.pipelining` class the trainer runs); `simulate`
runs the programs against their dependencies with given op costs and returns when each op
runs:

- F(stage k, mb) waits for F(k-1, mb); B(k, mb) waits for B(k+1, mb) and F(k, mb); W(k, mb)
  follows B(k, mb) on its rank.
- gpipe (ScheduleGPipe): all forwards, then all backwards. 1f1b (Schedule1F1B,
  PipeDream-Flush): rank r runs p-1-r forwards, then alternates one forward and one
  backward, then drains the backwards.
- interleaved_1f1b (ScheduleInterleaved1F1B, Megatron's): rank r holds chunks r, r+p, ... of
  the p*v stages; micro-batches go in rounds of q = m / max(1, m // p) (p when p divides m),
  forwards chunk 0 first, backwards the chunks reversed; the warm-up is (v-1)q + 2(p-1-r)
  forwards (also at v = 1, where torch's class differs from Schedule1F1B).
- zero_bubble (ScheduleInterleavedZeroBubble, ZB1P of Qi et al. 2023): the same rounds with
  a warm-up of (v-1)q + (p-1-r) forwards, each backward split into B (input gradients, on
  the critical path) and W (weight gradients); from its (r+1)-th steady step on, rank r
  runs the oldest pending W after each B, and the rest at the end.
- zbv (ScheduleZBVZeroBubble), dualpipev (ScheduleDualPipeV): two chunks per rank in a V
  (chunk a is stage r, chunk b stage 2p-1-r), in torch's own op order
  (`launcher/plan/pipeline/schedule_v.py`), W ops where torch places them.
- 2bw (PipeDream-2BW): 1F1B over several steps with no flush between them, in the order
  the trainer runs (`core/pipedream.py`); micro-batches are numbered on across
  steps, so step j's are jm ... jm+m-1. A step's first forward runs on the update of two
  steps before, which needs every rank's gradient of that step (the global norm for
  clipping, agreed without blocking as soon as a rank's gradient is complete): so it also
  waits for every rank's last backward of that step (`agree=False` leaves that out).

Costs are per op of one chunk (a chunk holds 1/v of a rank's layers); an unsplit backward
costs b + w. In-flight counts the micro-batches whose activations a rank holds (from the
start of F to the end of the backward, W included), in units of a whole stage (chunks count
1/v); `held_in_flight` gives the count the program order implies, in closed form.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from pretrain.core import pipedream
from pretrain.core.schedules import PIPEDREAM, SCHEDULES
from pretrain.core.stages import placement, rank_stages
from pretrain.launcher.plan.pipeline.schedule_v import TORCH_ORDERS

SIMULATED = tuple(name for name, traits in SCHEDULES.items() if traits.simulated)
"""Schedules whose micro-batches in flight are read off their simulated order."""
SIMULATED_STEPS = 3
"""Steps of a 2bw segment simulated for its bubble; longer segments are extrapolated."""
IDLE = "."


@dataclass(frozen=True)
class Op:
    """One unit of work on a rank: kind F, B (whole backward, or input grads) or W."""

    kind: str
    microbatch: int
    chunk: int = 0


@dataclass(frozen=True)
class Slot:
    """An op placed in time on its rank."""

    op: Op
    start: float
    end: float


@dataclass
class Timeline:
    """When every op of a (schedule, p, m, v) runs, per pipeline rank."""

    schedule: str
    pp: int
    microbatches: int
    vpp: int
    rows: list[list[Slot]] = field(default_factory=list)
    steps: int = 1
    """Optimizer steps the timeline spans (2bw runs several without a flush)."""

    @property
    def makespan(self) -> float:
        """Time from the first op to the last, over all ranks."""
        return max(s.end for row in self.rows for s in row)

    def busy(self, rank: int) -> float:
        """Time rank `rank` spends running ops."""
        return sum(s.end - s.start for s in self.rows[rank])

    def idle_fraction(self, rank: int) -> float:
        """Share of the makespan rank `rank` sits idle."""
        return 1 - self.busy(rank) / self.makespan

    @property
    def bubble_fraction(self) -> float:
        """Idle share of all ranks' time over the step."""
        return 1 - sum(self.busy(r) for r in range(self.pp)) / (self.pp * self.makespan)

    def peak_in_flight(self, rank: int, chunk: int | None = None) -> float:
        """Most micro-batches whose activations rank `rank` holds at once (whole stages), or
        of one `chunk` alone (whole micro-batches of that chunk)."""
        events: list[tuple[float, int]] = []
        last_use: dict[tuple[int, int], float] = {}
        for slot in self.rows[rank]:
            if chunk is not None and slot.op.chunk != chunk:
                continue
            key = (slot.op.microbatch, slot.op.chunk)
            if slot.op.kind == "F":
                events.append((slot.start, 1))
            else:
                last_use[key] = max(last_use.get(key, 0.0), slot.end)
        events += [(end, -1) for end in last_use.values()]
        held = peak = 0
        for _, delta in sorted(events):  # at equal times releases (-1) sort first
            held += delta
            peak = max(peak, held)
        return peak if chunk is not None else peak / self.vpp

    def chart(self) -> str:
        """Rows = pipeline ranks, columns = unit time slots; each cell the op (kind,
        micro-batch, chunk letter when vpp > 1) that runs then, `.` when idle."""
        width = max(len(_label(s.op, self.vpp)) for row in self.rows for s in row)
        slots = round(self.makespan)
        lines = []
        for rank, row in enumerate(self.rows):
            cells = [IDLE.center(width)] * slots
            for slot in row:
                for t in range(round(slot.start), round(slot.end)):
                    cells[t] = _label(slot.op, self.vpp).ljust(width)
            lines.append(f"stage {rank:>2} | " + " ".join(cells))
        return "\n".join(lines)


def _label(op: Op, vpp: int) -> str:
    return f"{op.kind}{op.microbatch}" + (chr(ord("a") + op.chunk) if vpp > 1 else "")


def rounds(pp: int, microbatches: int) -> int:
    """Micro-batches per round of the multi-stage schedules: m / max(1, m // p).

    torch's interleaved and zero-bubble classes need it to divide m (p does when m % p == 0).
    """
    return microbatches // max(1, microbatches // pp)


def warmup(schedule: str, pp: int, microbatches: int, rank: int, vpp: int = 1) -> int:
    """Forwards rank `rank` runs before its first backward (all of them under gpipe)."""
    traits = SCHEDULES[schedule]
    if traits.warmup_hops is None:
        return microbatches
    hops = traits.warmup_hops * (pp - 1 - rank)
    if not traits.interleaved:
        return min(hops, microbatches)
    return min((vpp - 1) * rounds(pp, microbatches) + hops, microbatches * vpp)


def program(
    schedule: str, pp: int, microbatches: int, rank: int, vpp: int = 1, steps: int = 1
) -> list[Op]:
    """The order of rank `rank`'s ops: F and B, and W under zero_bubble and the V schedules
    (2bw spans `steps` steps and the drain after them)."""
    m, traits = microbatches, SCHEDULES[schedule]
    torch_order = TORCH_ORDERS.get(traits.torch_class or "")
    if torch_order:
        return [Op(kind, mb, chunk) for kind, chunk, mb in torch_order(pp, m, rank)]
    if not traits.flushes:
        return [Op(kind, mb) for kind, mb in pipedream.segment_ops(pp, m, rank, steps)]
    if traits.warmup_hops is None:
        return [Op("F", i) for i in range(m)] + [Op("B", i) for i in range(m)]
    warm = warmup(schedule, pp, m, rank, vpp)
    if not traits.interleaved:
        ops = [Op("F", i) for i in range(warm)]
        for i in range(m - warm):
            ops += [Op("F", warm + i), Op("B", i)]
        return ops + [Op("B", i) for i in range(m - warm, m)]
    # Multi-stage: the k-th forward runs chunk (k // q) % v, the k-th backward chunk
    # v - 1 - (k // q) % v; micro-batches count up per chunk.
    q, total = rounds(pp, m), m * vpp
    counts: dict[tuple[str, int], int] = {}

    def nth(kind: str, k: int) -> Op:
        chunk = (k // q) % vpp
        chunk = chunk if kind == "F" else vpp - 1 - chunk
        mb = counts.get((kind, chunk), 0)
        counts[(kind, chunk)] = mb + 1
        return Op(kind, mb, chunk)

    ops = [nth("F", k) for k in range(warm)]
    backwards: list[Op] = []
    for k in range(total):
        if k < total - warm:
            ops.append(nth("F", warm + k))
        backwards.append(nth("B", k))
        ops.append(backwards[-1])
        if traits.split_backward and k >= rank:
            ops.append(_weight(backwards[k - rank]))
    if traits.split_backward:
        ops += [_weight(op) for op in backwards[max(0, total - rank) :]]
    return ops


def _weight(backward: Op) -> Op:
    return Op("W", backward.microbatch, backward.chunk)


def held_in_flight(schedule: str, pp: int, microbatches: int, rank: int, vpp: int = 1) -> float:
    """Most micro-batches (whole stages) rank `rank` holds activations of, from its program
    order: a forward takes one chunk's, its backward (its W when split) frees them.

    In closed form: the warm-up forwards and the one before the first backward (all m
    under gpipe); zero_bubble adds one per steady step until its W ops start, r steps in.
    The V schedules and 2bw are read off their simulated order.
    """
    traits = SCHEDULES[schedule]
    if traits.warmup_hops is None:
        return float(microbatches)
    if traits.simulated:
        return _simulated_in_flight(schedule, pp, microbatches, vpp)[rank]
    held = warmup(schedule, pp, microbatches, rank, vpp) + 1
    if traits.split_backward:
        held += rank
    return min(held, microbatches * vpp) / vpp


@lru_cache(maxsize=64)
def _simulated_in_flight(schedule: str, pp: int, microbatches: int, vpp: int) -> tuple:
    """Per rank, the simulated peak in flight (2bw: over two steps, its steady state)."""
    steps = 1 if SCHEDULES[schedule].flushes else 2
    timeline = simulate(schedule, pp, microbatches, vpp, steps=steps)
    return tuple(timeline.peak_in_flight(r) for r in range(pp))


def bubble_fraction(
    schedule: str, pp: int, microbatches: int, vpp: int = 1, steps: int = 1
) -> float:
    """Idle share of a pipeline step with equal stages: x / (1 + x), x = (p - 1) / (v m).

    Each rank idles (p - 1) / v stage-times per step beside its m busy ones (v = 1 but under
    the interleaved schedules). zero_bubble gets the interleaved value, an upper bound: how
    much of it the split backward fills depends on the timing of each stage. The V
    schedules get their simulated value (F = B = W), and 2bw that of a segment of `steps`
    steps between two drains (the pipeline fills once per segment).
    """
    if pp == 1:
        return 0.0
    traits = SCHEDULES[schedule]
    if not traits.flushes:
        return pipedream_bubble(pp, microbatches, steps)
    if traits.simulated:
        return simulate(schedule, pp, microbatches, vpp).bubble_fraction
    chunks = vpp if traits.interleaved else 1
    idle = (pp - 1) / (chunks * microbatches)
    return idle / (1 + idle)


def simulate(
    schedule: str,
    pp: int,
    microbatches: int,
    vpp: int = 1,
    f: float = 1.0,
    b: float = 1.0,
    w: float = 1.0,
    steps: int = 1,
    agree: bool = True,
) -> Timeline:
    """Run every rank's program with op costs f (forward), b (input grads), w (weight
    grads); an unsplit backward costs b + w. Each rank runs its ops in program order, each
    as soon as the rank is free and its inputs have arrived (no communication time).
    `steps` counts 2bw's steps; with `agree`, a step's first op waits for the update it runs
    on (see the module's doc)."""
    last_stage, flushes = pp * vpp - 1, SCHEDULES[schedule].flushes
    programs = [program(schedule, pp, microbatches, r, vpp, steps) for r in range(pp)]
    chunks = [rank_stages(r, pp, vpp, placement(schedule)) for r in range(pp)]
    # Backwards the program follows with an explicit W compute the input grads only.
    weighed = [{(op.microbatch, op.chunk) for op in ops if op.kind == "W"} for ops in programs]
    position = [0] * pp
    free = [0.0] * pp
    # 2bw: the ops that start a step wait for the update it runs on.
    waits = [
        _update_waits(pp, microbatches, r, steps) if not flushes and agree else {}
        for r in range(pp)
    ]
    done: dict[tuple[str, int, int], float] = {}  # (kind, stage, mb) -> end time
    rows: list[list[Slot]] = [[] for _ in range(pp)]

    def stage_of(rank: int, op: Op) -> int:
        return chunks[rank][op.chunk]

    def ready_time(rank: int, op: Op) -> float | None:
        stage = stage_of(rank, op)
        if op.kind == "F":
            deps = [("F", stage - 1, op.microbatch)] if stage > 0 else []
        elif op.kind == "W":
            deps = [("B", stage, op.microbatch)]
        else:
            deps = [("F", stage, op.microbatch)]
            if stage < last_stage:
                deps.append(("B", stage + 1, op.microbatch))
        deps += waits[rank].get(position[rank], [])
        if any(d not in done for d in deps):
            return None
        return max([done[d] for d in deps], default=0.0)

    def cost(rank: int, op: Op) -> float:
        if op.kind == "F":
            return f
        if op.kind == "W":
            return w
        return b if (op.microbatch, op.chunk) in weighed[rank] else b + w

    while any(position[r] < len(programs[r]) for r in range(pp)):
        best: tuple[float, int] | None = None  # (start, rank)
        for r in range(pp):
            if position[r] == len(programs[r]):
                continue
            ready = ready_time(r, programs[r][position[r]])
            if ready is not None and (best is None or (max(free[r], ready), r) < best):
                best = (max(free[r], ready), r)
        assert best is not None, "the schedule deadlocks"
        start, r = best
        op = programs[r][position[r]]
        position[r] += 1
        end = start + cost(r, op)
        rows[r].append(Slot(op, start, end))
        free[r] = end
        done[(op.kind, stage_of(r, op), op.microbatch)] = end
    return Timeline(schedule, pp, microbatches, vpp, rows, steps)


def _update_waits(
    pp: int, microbatches: int, rank: int, steps: int
) -> dict[int, list[tuple[str, int, int]]]:
    """2bw: by op index of rank `rank`'s program, the ops a step's first op waits for: the
    last backward (every rank's) of the step whose update it runs on, two steps before
    (none for the first two steps)."""
    starts = _step_starts(pp, microbatches, rank, steps)
    return {
        index: [("B", stage, (step - 1) * microbatches - 1) for stage in range(pp)]
        for step, index in enumerate(starts, start=1)
        if step >= 2
    }


def _step_starts(pp: int, microbatches: int, rank: int, steps: int) -> list[int]:
    """Op indices in rank `rank`'s 2bw program where steps 1 ... steps-1 begin."""
    starts, index = [], 0
    for step in range(steps - 1):
        index += len(pipedream.step_ops(pp, microbatches, rank, step))
        starts.append(index)
    return starts


def pipedream_bubble(
    pp: int, microbatches: int, steps: int, f: float = 1.0, b: float = 1.0, w: float = 1.0
) -> float:
    """Idle share of a 2bw segment of `steps` steps (from an empty pipeline to its drain).

    Simulated over up to SIMULATED_STEPS steps; past the second, a step of the steady state
    adds m(f+b+w) of work to every rank and the same idle time as the step before (none,
    once the pipeline is full), which extends the simulation to any length exactly
    (tests/unit/test_pipedream.py checks it against longer simulations).
    """

    def idle(n: int) -> float:
        timeline = simulate(PIPEDREAM, pp, microbatches, f=f, b=b, w=w, steps=n)
        return sum(timeline.makespan - timeline.busy(r) for r in range(pp))

    simulated = min(steps, SIMULATED_STEPS)
    total = idle(simulated)
    if steps > simulated:
        total += (steps - simulated) * (total - idle(simulated - 1))
    busy = pp * steps * microbatches * (f + b + w)
    return total / (total + busy)


def summary(schedule: str, pp: int, microbatches: int, vpp: int = 1, steps: int = 1) -> dict:
    """What the plan reports: bubble, idle share and peak in-flight per stage at the real
    micro-batch count, and the chart for at most 2p micro-batches (a multiple of p); 2bw is
    charted over two steps and its bubble is that of a segment of `steps` steps."""
    flushes = SCHEDULES[schedule].flushes
    shown_steps = 1 if flushes else min(steps, 2)
    full = simulate(schedule, pp, microbatches, vpp, steps=shown_steps)
    charted = min(microbatches, 2 * pp)
    shown = full
    if charted != microbatches:
        shown = simulate(schedule, pp, charted, vpp, steps=shown_steps)
    bubble = full.bubble_fraction
    if not flushes:
        bubble = pipedream_bubble(pp, microbatches, steps)
    return {
        "schedule": schedule,
        "microbatches": microbatches,
        "charted_microbatches": charted,
        "charted_steps": shown_steps,
        "segment_steps": 1 if flushes else steps,
        "costs": "F=1 B=1 W=1 per chunk (an unsplit backward is B+W=2), no communication time",
        "bubble_fraction": bubble,
        "idle_fraction_per_stage": [full.idle_fraction(r) for r in range(pp)],
        "peak_in_flight_per_stage": [full.peak_in_flight(r) for r in range(pp)],
        "charted_bubble_fraction": shown.bubble_fraction,
        "chart": shown.chart(),
    }
