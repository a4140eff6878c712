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

import functools
import itertools

from pretrain.core.schedules import LOOP, SCHEDULES


def placement(schedule: str) -> str:
    """How `schedule` places chunks on ranks: "v" for the V-shaped schedules, else "loop"."""
    traits = SCHEDULES.get(schedule)
    return traits.placement if traits else LOOP


def layers_per_stage(n_layers: int, stages: int, pp_layers: list[int] | None = None) -> list[int]:
    """Layer counts of the `stages` stages: `pp_layers` when given, else an even split."""
    if pp_layers:
        return list(pp_layers)
    return [n_layers // stages] * stages


def balanced_split(n_layers: int, stages: int) -> list[int]:
    """Layer counts for `stages` stages when they need not divide `n_layers`.

    An even split when they do; else Megatron's uneven one (its
    `--decoder-first/last-pipeline-num-layers`): every middle stage holds ceil(n / stages)
    layers and the first and last share the rest, fewer, since they also hold the embedding
    and the LM head (the last no more than the first). Where the rest is too small for
    two stages, the remainder goes one layer each to the middle stages.
    """
    if n_layers % stages == 0:
        return [n_layers // stages] * stages
    per_stage = -(-n_layers // stages)
    rest = n_layers - (stages - 2) * per_stage
    if stages > 2 and rest >= 2:
        return [rest - rest // 2] + [per_stage] * (stages - 2) + [rest // 2]
    counts = [n_layers // stages] * stages
    extra = n_layers % stages
    for i in range(extra):
        counts[(stages - extra) // 2 + i] += 1
    return counts


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


def stage_ranks(pp: int, vpp: int = 1, style: str = "loop") -> list[int]:
    """The pipeline rank that holds each of the pp * vpp stages, in model order."""
    owners = [0] * (pp * vpp)
    for rank in range(pp):
        for stage in rank_stages(rank, pp, vpp, style):
            owners[stage] = rank
    return owners


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
    return rank_layer_counts(n_layers, pp, vpp, pp_layers, style)[pp_rank]


def rank_layer_counts(
    n_layers: int,
    pp: int,
    vpp: int = 1,
    pp_layers: list[int] | None = None,
    style: str = "loop",
) -> list[int]:
    """Layers each pipeline rank holds over all its chunks, by rank."""
    return list(_rank_layer_counts(n_layers, pp, vpp, tuple(pp_layers or ()), style))


@functools.lru_cache(maxsize=65536)
def _rank_layer_counts(
    n_layers: int, pp: int, vpp: int, pp_layers: tuple[int, ...], style: str
) -> tuple[int, ...]:
    # Cached: the planner asks it of every rank of thousands of layouts.
    counts = layers_per_stage(n_layers, pp * vpp, list(pp_layers))
    return tuple(sum(counts[k] for k in rank_stages(r, pp, vpp, style)) for r in range(pp))


def rank_layer_indices(
    n_layers: int,
    pp: int,
    vpp: int = 1,
    pp_layers: list[int] | None = None,
    pp_rank: int = 0,
    style: str = "loop",
) -> tuple[int, ...]:
    """Global indices of the layers pipeline rank `pp_rank` holds over all its chunks."""
    return _rank_layer_indices(n_layers, pp, vpp, tuple(pp_layers or ()), pp_rank, style)


@functools.lru_cache(maxsize=65536)
def _rank_layer_indices(
    n_layers: int, pp: int, vpp: int, pp_layers: tuple[int, ...], pp_rank: int, style: str
) -> tuple[int, ...]:
    # Cached: the layout search asks it of every rank of thousands of layouts.
    starts = [0, *itertools.accumulate(layers_per_stage(n_layers, pp * vpp, list(pp_layers)))]
    return tuple(
        layer
        for k in rank_stages(pp_rank, pp, vpp, style)
        for layer in range(starts[k], starts[k + 1])
    )
