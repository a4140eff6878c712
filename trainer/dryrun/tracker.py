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
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _State
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
        self.peak_at = ""
        """Where the peak was reached: forward or backward, of which module."""
        self.compute_peak: dict[torch.device, dict[str, int]] = {}
        """The snapshot of the peak outside the optimizer step, per device."""
        self.compute_peak_at = ""

    def _update_peak_stats(self, peak_state: _State) -> None:
        # After every op torch's tracker also updates the peak of each module it has seen
        # that is running, with a pass over all of them (hundreds: every linear of every
        # block) whose weak references are costly to read: most of a dry run's time, and
        # growing with layers x ops. Only the device's peaks are read here.
        for device, snapshot in self._curr_mem_snap.items():
            total = snapshot[_TOTAL_KEY]
            if self._peak_mem.get(device, 0) < total:
                self._peak_mem[device] = total
                self._peak_mem_snap[device] = dict(snapshot)
                self.peak_at = self._where()
            if not self._in_opt and self.compute_peak.get(device, {}).get(_TOTAL_KEY, 0) < total:
                self.compute_peak[device] = dict(snapshot)
                self.compute_peak_at = self._where()

    def _where(self) -> str:
        """The innermost module running, and whether in forward or backward (or the
        optimizer step)."""
        if self._in_opt:
            return "optimizer step"
        tracker = self._mod_tracker
        modules = [name for name in tracker.parents if name != "Global"]
        innermost = max(modules, key=len) if modules else "outside any module"
        return f"{'backward' if tracker.is_bw else 'forward'} of {innermost}"

    def _pre_fw_hook(self, module: nn.Module, inputs: Any) -> None:
        tracker = self._mod_tracker
        top_level = set(tracker.parents) - {tracker.get_known_fqn(module)} <= {"Global"}
        if module in self.memory_tracking and not tracker.is_bw and top_level:
            del self.memory_tracking[module]
        super()._pre_fw_hook(module, inputs)
