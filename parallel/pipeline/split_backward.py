"""FSDP2's ZeRO-3 under the schedules that split each backward (zero_bubble, zbv, dualpipev).

torch's stage finds a micro-batch's weights by `submod.parameters()` when its input-gradient
pass starts, and again for the weight pass: the gradient-edge of each weight maps the graph's
intermediates to the parameters they reach (torch/distributed/pipelining/_backward.py).
Under ZeRO-3 a later micro-batch's forward has resharded the blocks by then, so the module
registers FSDP's sharded parameters, not the unsharded ones the forward's graph used: their
edges are not in the graph, and the weight pass leaves those gradients out (measured:
zero_bubble with ZeRO-3 started at gradient norm 1.68 where one process has 2.06). Gathering
the stage's FSDP units before both passes registers the unsharded parameters again: the
same all-gathers the backward makes anyway, since the pipeline keeps blocks unsharded from
their backward to the step's gradient reduction (torch sets reshard_after_backward=False).
"""

from __future__ import annotations

from typing import Any

from torch.distributed.fsdp import FSDPModule


def gather_before_split_backward(stage: Any) -> None:
    """Make `stage` (a torch `PipelineStage`) unshard its FSDP units before each input or
    weight pass; a stage without FSDP is left as it is."""
    units = [m for m in stage.submod.modules() if isinstance(m, FSDPModule)]
    if not units:
        return
    run = stage.backward_maybe_with_nosync

    def gathered(backward_type: str, *args: Any, **kwargs: Any) -> Any:
        if backward_type in ("input", "weight"):
            for unit in units:
                unit.unshard()
        return run(backward_type, *args, **kwargs)

    stage.backward_maybe_with_nosync = gathered
