"""torch's memory tracker, over a step of many micro-batches and any pipeline schedule.

`MemTracker` keeps per-module statistics of one forward and refuses a second forward of a
top-level module; a step runs the model once per micro-batch. Only the tracker's device
totals by category are read here, so a top-level module's statistics are dropped before
its next forward (the totals, and the peak, are kept across).

Its module tracker learns where each module's backward ends from a hook on the module's
inputs. A pipeline stage's input is a received activation, a leaf, and the split backward
of the zero-bubble schedules computes its gradient with `torch.autograd.grad`, inside which
torch's hook over several tensors cannot ask about a leaf; such inputs are left out of it
(a module whose inputs are all leaves has its backward closed at the end of the backward).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed._tools.mod_tracker import ModTracker
from torch.utils._pytree import tree_flatten


class _LeafFreeModTracker(ModTracker):
    """A `ModTracker` that hooks no leaf input of a module."""

    def _fw_pre_hook(self, mod: nn.Module, input: Any) -> None:
        args, _ = tree_flatten(input)
        kept = [a for a in args if not (isinstance(a, torch.Tensor) and a.is_leaf)]
        super()._fw_pre_hook(mod, tuple(kept))


class StepMemTracker(MemTracker):
    """A `MemTracker` whose top-level modules may run forward more than once."""

    def __init__(self) -> None:
        super().__init__()
        self._mod_tracker = _LeafFreeModTracker()

    def _pre_fw_hook(self, module: nn.Module, inputs: Any) -> None:
        tracker = self._mod_tracker
        top_level = set(tracker.parents) - {tracker.get_known_fqn(module)} <= {"Global"}
        if module in self.memory_tracking and not tracker.is_bw and top_level:
            del self.memory_tracking[module]
        super()._pre_fw_hook(module, inputs)
