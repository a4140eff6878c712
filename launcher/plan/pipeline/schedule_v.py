"""The op order of the V-shaped schedules, as `torch.distributed.pipelining` builds it.

Pure Python (the launcher imports no torch) and written from torch 2.13's
`ScheduleZBVZeroBubble._calculate_single_rank_operations` and
`ScheduleDualPipeV._calculate_single_rank_operations`; `tests/unit/test_schedule_v.py`
compares every rank's order with torch's own `pipeline_order` for the shapes the trainer
accepts, so the plan charts the schedule that runs.

A rank holds chunk 0 (stage r) and chunk 1 (stage 2p-1-r). Ops are (kind, chunk,
micro-batch): F forward; B backward, of the inputs only when a W (the weights' gradient)
for the same chunk and micro-batch follows later, else the whole backward. DualPipeV's
overlapped forward-backward pairs are listed as the forward, then the backward, the order
torch runs them in on one stream.
"""

from __future__ import annotations

from collections.abc import Callable


def zbv_order(pp: int, microbatches: int, rank: int) -> list[tuple[str, int, int]]:
    """ZB-V (Qi et al. 2024, section 6): warm-up forwards down the V, then F, B, W per chunk.

    Orders are built for at least 2p-1 micro-batches (what fills the V) and the ops of the
    micro-batches beyond `microbatches` dropped, as torch does.
    """
    n = max(2 * pp - 1, microbatches)
    ops: list[tuple[str, int, int]] = []
    count = {("F", 0): 0, ("F", 1): 0, ("B", 0): 0, ("B", 1): 0}

    def add(kind: str, chunk: int, counter: str | None = None) -> None:
        key = (counter or kind, chunk)
        ops.append((kind, chunk, count[key]))
        if counter is None:
            count[key] += 1

    for _ in range(2 * (pp - rank) - 1):
        add("F", 0)
    for _ in range(rank):
        add("F", 1)
        add("F", 0)
    for _ in range(pp - rank):
        add("F", 1)
        add("B", 1, "B")
        add("W", 1, "B")
        count[("B", 1)] += 1
    while count[("F", 1)] < count[("F", 0)] or count[("F", 0)] < n:
        if count[("F", 0)] < n:
            add("F", 0)
        add("B", 0, "B")
        add("W", 0, "B")
        count[("B", 0)] += 1
        add("F", 1)
        add("B", 1, "B")
        add("W", 1, "B")
        count[("B", 1)] += 1
    weights = {0: count[("B", 0)], 1: count[("B", 1)]}
    for _ in range(rank):
        add("B", 0)
        add("B", 1)
    for _ in range(pp - rank):
        add("B", 0)
        ops.append(("W", 0, weights[0]))
        weights[0] += 1
    for chunk in (1, 0):
        while weights[chunk] < count[("B", chunk)]:
            ops.append(("W", chunk, weights[chunk]))
            weights[chunk] += 1
    return [op for op in ops if op[2] < microbatches]


def dualpipev_order(pp: int, microbatches: int, rank: int) -> list[tuple[str, int, int]]:
    """DualPipeV (DeepSeek-V3's DualPipe folded into a V), in its eight steps."""
    ops: list[tuple[str, int, int]] = []
    count: dict[tuple[str, int], int] = {}
    weight_queue: list[tuple[int, int]] = []

    def next_mb(kind: str, chunk: int) -> int:
        mb = count.get((kind, chunk), 0)
        count[(kind, chunk)] = mb + 1
        return mb

    def forward(chunk: int) -> None:
        ops.append(("F", chunk, next_mb("F", chunk)))

    def backward(chunk: int, split: bool) -> None:
        mb = next_mb("B", chunk)
        ops.append(("B", chunk, mb))
        if split:
            weight_queue.append((chunk, mb))

    def weight() -> None:
        if weight_queue:
            chunk, mb = weight_queue.pop(0)
            ops.append(("W", chunk, mb))

    for _ in range((pp - rank - 1) * 2):
        forward(0)
    for _ in range(rank + 1):
        forward(0)
        forward(1)
    for _ in range(pp - rank - 1):
        backward(1, split=True)
        weight()
        forward(1)
    for _ in range(microbatches - pp * 2 + rank + 1):
        forward(0)
        backward(1, split=False)  # overlapped with the forward, except the last rank's first
        forward(1)
        backward(0, split=False)
    for _ in range(pp - rank - 1):
        backward(1, split=False)
        forward(1)
        backward(0, split=False)
    split = False
    steps = rank + 1
    for i in range(steps):
        if i == steps // 2 and rank % 2 == 1:
            split = True
        backward(1, split)
        if i == steps // 2 and rank % 2 == 0:
            split = True
        backward(0, split)
    for _ in range(pp - rank - 1):
        weight()
        backward(0, split)
    for _ in range(rank + 1):
        weight()
    return ops


TORCH_ORDERS: dict[str, Callable[[int, int, int], list[tuple[str, int, int]]]] = {
    "ScheduleZBVZeroBubble": zbv_order,
    "ScheduleDualPipeV": dualpipev_order,
}
"""The orders above by the torch class they are written from (the schedule table's
`torch_class`): the simulator runs a V schedule's through it."""
