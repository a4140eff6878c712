"""The pipeline schedules: every trait of every `parallel.pp_schedule` value, written once.

Validation, the simulator, the memory and cost models, the plan's notes, the trainer and
`parallel/pipeline/` read their decisions off this table instead of naming schedules, so a
schedule is added here (and in the files CONTRIBUTING.md lists) and nowhere else;
`tests/unit/test_schedule_table.py` fails on a schedule name spelled outside this module.
The torch class is a name (this package imports no torch): `parallel/pipeline/stages.py`
resolves it in `torch.distributed.pipelining.schedules`.
"""

from __future__ import annotations

from dataclasses import dataclass

LOOP = "loop"
"""Placement of chunks r, r + pp, r + 2 pp, ... on rank r (`core/stages.py`)."""
V = "v"
"""Placement of two chunks in a V on rank r: stages r and 2 pp - 1 - r."""


@dataclass(frozen=True)
class ScheduleTraits:
    """What the launcher and the trainer need to know of one pipeline schedule."""

    name: str
    """The `parallel.pp_schedule` value."""
    title: str
    """The schedule's name in prose, as messages write it."""
    torch_class: str | None
    """The `torch.distributed.pipelining.schedules` class the trainer runs; None for a
    schedule the repo runs itself (`trainer/step/pipedream.py`)."""
    chunks_per_rank: int | None = 1
    """Model chunks (virtual stages) each pipeline rank runs: a fixed count, or None for
    `parallel.vpp` of them (any vpp, 1 included), looped and run in rounds of
    m / max(1, m // pp) micro-batches, as torch's interleaved classes do."""
    placement: str = LOOP
    """Which stages a rank's chunks are: LOOP (r, r + pp, ...) or V (r and 2 pp - 1 - r, so
    rank 0 holds both the embedding and the loss)."""
    split_backward: bool = False
    """Each backward runs as input gradients (B) and, later, weight gradients (W), calling
    backward with retain_graph=True, which a compiled block refuses."""
    warmup_hops: int | None = 1
    """Forwards a rank runs ahead of its first backward per pipeline rank after it (on top
    of a round per further chunk): 1 for 1F1B and ZB1P, 2 for Megatron's interleaved 1F1B
    (which torch keeps at vpp = 1 too); None runs every forward before the first backward
    (GPipe: no steady state). Read by the looped orders the simulator builds itself."""
    simulated: bool = False
    """The bubble and the micro-batches in flight have no closed form and are read off the
    simulated op order: torch's own (V placement, `launcher/plan/pipeline/schedule_v.py`) or the
    repo's (`core/pipedream.py`)."""
    flushes: bool = True
    """The pipeline drains at every optimizer step; False keeps it full across steps
    (PipeDream-2BW: each step's gradient applied one step late), which needs pp > 1 and is
    simulated and charted over several steps, its bubble per segment between drains."""
    weight_versions: int = 1
    """Copies of each stage's weights a rank holds (with pp > 1)."""
    fills_every_stage: bool = False
    """Needs at least as many micro-batches as stages (pp x chunks), not only as ranks."""

    @property
    def interleaved(self) -> bool:
        """Runs `parallel.vpp` looped chunks in rounds (see `chunks_per_rank`)."""
        return self.chunks_per_rank is None

    @property
    def multi_stage(self) -> bool:
        """Takes a list of stages per rank (torch's multi-stage classes), not exactly one."""
        return self.chunks_per_rank != 1

    def chunks(self, vpp: int) -> int:
        """Chunks per rank under `parallel.vpp=vpp`."""
        return vpp if self.chunks_per_rank is None else self.chunks_per_rank


SCHEDULES: dict[str, ScheduleTraits] = {
    traits.name: traits
    for traits in (
        ScheduleTraits("gpipe", "GPipe", "ScheduleGPipe", warmup_hops=None),
        ScheduleTraits("1f1b", "1F1B", "Schedule1F1B"),
        ScheduleTraits(
            "interleaved_1f1b",
            "interleaved 1F1B",
            "ScheduleInterleaved1F1B",
            chunks_per_rank=None,
            warmup_hops=2,
        ),
        ScheduleTraits(
            "zero_bubble",
            "zero-bubble (ZB1P)",
            "ScheduleInterleavedZeroBubble",
            chunks_per_rank=None,
            split_backward=True,
        ),
        ScheduleTraits(
            "zbv",
            "ZB-V",
            "ScheduleZBVZeroBubble",
            chunks_per_rank=2,
            placement=V,
            split_backward=True,
            simulated=True,
        ),
        ScheduleTraits(
            "dualpipev",
            "DualPipeV",
            "ScheduleDualPipeV",
            chunks_per_rank=2,
            placement=V,
            split_backward=True,
            simulated=True,
            fills_every_stage=True,
        ),
        ScheduleTraits(
            "2bw",
            "PipeDream-2BW",
            None,
            simulated=True,
            flushes=False,
            weight_versions=2,
        ),
    )
}
"""Every pipeline schedule by its `parallel.pp_schedule` value, in the order `--help` lists."""

PIPEDREAM = "2bw"
"""The schedule whose op order `core/pipedream.py` writes (PipeDream-2BW)."""
DEFAULT = "1f1b"
"""The schedule of a recipe that names none."""
DEFAULT_INTERLEAVED = "interleaved_1f1b"
"""The schedule a layout search gives more than one chunk per rank."""


def default_schedule(vpp: int) -> str:
    """The schedule a layout search gives `vpp` chunks per rank."""
    return DEFAULT_INTERLEAVED if vpp > 1 else DEFAULT


def splits_backward(pp: int, schedule: str) -> bool:
    """Whether a pipeline of `pp` ranks under `schedule` splits each backward into an
    input-gradient pass and a weight pass (zero_bubble, zbv, dualpipev)."""
    traits = SCHEDULES.get(schedule)
    return pp > 1 and traits is not None and traits.split_backward
