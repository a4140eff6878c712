"""torch's memory tracker, over a step of many micro-batches.

`MemTracker` keeps per-module statistics of one forward and refuses a second forward of a
top-level module; a step runs the model once per micro-batch. Only the tracker's device
totals by category are read here, so a top-level module's statistics are dropped before
its next forward (the totals, and the peak, are kept across).
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker


class StepMemTracker(MemTracker):
    """A `MemTracker` whose top-level modules may run forward more than once."""

    def _pre_fw_hook(self, module: nn.Module, inputs: Any) -> None:
        tracker = self._mod_tracker
        top_level = set(tracker.parents) - {tracker.get_known_fqn(module)} <= {"Global"}
        if module in self.memory_tracking and not tracker.is_bw and top_level:
            del self.memory_tracking[module]
        super()._pre_fw_hook(module, inputs)
