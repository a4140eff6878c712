"""Which layers each pipeline stage holds, and which stages each pipeline rank runs.

Pure arithmetic shared by validation, the plan and the trainer. There are pp * vpp stages
in model order; stage k holds a contiguous range of layers (`parallel.pp_layers` lists the
counts for uneven splits, else every stage gets n_layers / (pp * vpp)). Rank r of the
pipeline runs stages r, r + pp, r + 2 pp, ... (the looped placement interleaved schedules
use), so with vpp > 1 its chunks are not contiguous; the V-shaped schedules (ZB-V,
DualPipeV) place vpp = 2 chunks in a V instead: rank r runs stages r and 2 pp - 1 - r, so
the first rank holds both the first and the last stage and a micro-batch turns around on
the last rank without crossing a link. The embedding belongs to stage 0, the final norm, LM
head and loss to the last stage.
"""

from __future__ import annotations

V_SCHEDULES = ("zbv", "dualpipev")
"""Pipeline schedules that place their two chunks per rank in a V."""


def placement(schedule: str) -> str:
    """How `schedule` places chunks on ranks: "v" for the V-shaped schedules, else "loop"."""
    return "v" if schedule in V_SCHEDULES else "loop"


def layers_per_stage(n_layers: int, stages: int, pp_layers: list[int] | None = None) -> list[int]:
    """Layer counts of the `stages` stages: `pp_layers` when given, else an even split."""
    if pp_layers:
        return list(pp_layers)
    return [n_layers // stages] * stages


def stage_layers(
    n_layers: int, pp: int, vpp: int = 1, pp_layers: list[int] | None = None
) -> list[list[int]]:
    """Global layer indices of each of the pp * vpp stages, in model order."""
    ranges, start = [], 0
    for count in layers_per_stage(n_layers, pp * vpp, pp_layers):
        ranges.append(list(range(start, start + count)))
        start += count
    return ranges


def rank_stages(pp_rank: int, pp: int, vpp: int = 1, style: str = "loop") -> list[int]:
    """Stage indices that pipeline rank `pp_rank` runs, in model order: looped (r, r + pp,
    ...) or, with style "v" (vpp = 2), the V (r, 2 pp - 1 - r)."""
    if style == "v":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [chunk * pp + pp_rank for chunk in range(vpp)]


def head_rank(pp: int, vpp: int = 1, style: str = "loop") -> int:
    """The pipeline rank that holds the last stage (final norm, LM head and loss)."""
    return 0 if style == "v" else pp - 1


def rank_layer_count(
    n_layers: int,
    pp: int,
    vpp: int = 1,
    pp_layers: list[int] | None = None,
    pp_rank: int = 0,
    style: str = "loop",
) -> int:
    """Layers pipeline rank `pp_rank` holds over all its chunks."""
    stages = stage_layers(n_layers, pp, vpp, pp_layers)
    return sum(len(stages[k]) for k in rank_stages(pp_rank, pp, vpp, style))
