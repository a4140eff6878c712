"""PipeDream-2BW's op order per pipeline rank: 1F1B with no flush between optimizer steps.

Pure arithmetic that the trainer runs (`parallel/pipeline/pipedream.py`) and the planner charts
(`launcher/plan/pipeline/schedule_sim.py`), so the chart is the schedule that runs.

Micro-batches are numbered on over the steps of a segment: step j's are j*m ... j*m+m-1. A
segment starts with an empty pipeline (at the start of training, and after each
checkpoint, which drains it). Rank r of p keeps w = p-1-r forwards ahead of its backwards,
as 1F1B's warm-up does, and never drains between steps: its ops in step j are F(jm),
B(jm-w), F(jm+1), B(jm+1-w), ... (backwards of negative index dropped: the first step's
warm-up), so the last w backwards of step j run early in step j+1, between its forwards.
`drain` lists the backwards a segment leaves when it ends.

Weight versions (Narayanan et al. 2021): every micro-batch of step j runs its forward and
its backward on version j of the stage's weights; once step j's backwards are done, its
gradient updates version j+1 into version j+2, which step j+2 uses. Two versions are alive
on a stage at any time, the one in use and the one being written.
"""

from __future__ import annotations

from pretrain.core.schema import RecipeConfig


def warmup(pp: int, rank: int) -> int:
    """Forwards pipeline rank `rank` runs ahead of its backwards."""
    return pp - 1 - rank


def step_ops(pp: int, microbatches: int, rank: int, step: int) -> list[tuple[str, int]]:
    """(kind, micro-batch) of each op rank `rank` runs in step `step` of a segment, kind F
    (forward) or B (backward)."""
    ahead = warmup(pp, rank)
    ops = []
    for mb in range(step * microbatches, (step + 1) * microbatches):
        ops.append(("F", mb))
        if mb >= ahead:
            ops.append(("B", mb - ahead))
    return ops


def drain(pp: int, microbatches: int, rank: int, steps: int) -> list[tuple[str, int]]:
    """The backwards rank `rank` still owes after the last of `steps` steps of a segment."""
    end = steps * microbatches
    return [("B", mb) for mb in range(end - warmup(pp, rank), end)]


def segment_ops(pp: int, microbatches: int, rank: int, steps: int) -> list[tuple[str, int]]:
    """Every op of a segment of `steps` steps on rank `rank`, its drain included."""
    ops = [op for step in range(steps) for op in step_ops(pp, microbatches, rank, step)]
    return ops + drain(pp, microbatches, rank, steps)


def segment_steps(cfg: RecipeConfig) -> int:
    """Steps PipeDream-2BW runs between two drains of its pipeline: a checkpoint drains it."""
    every = cfg.checkpoint.every
    return min(cfg.train.steps, every) if every > 0 else cfg.train.steps
