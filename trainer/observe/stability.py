"""Stability monitors, sampled every `logging.stability_every` steps: per-layer gradient norm,
parameter norm and update-to-weight ratio, the RMS of each block's output, the largest
attention logit per layer and the output logits' z-mean, with an alert when one crosses its
threshold (`logging.stability_alerts`).

A sampled step is armed before it runs (`arm`). Inside it, the step hands the monitor its
gradients after unscaling and before clipping (`gradients`), and its optimizer update
(`update`: the weights' norms before it and the norm of the change it made, from a copy of
this rank's pieces of the weights); the forward hooks count the activations
(`trainer/observe/activation_probes.py`). None of that needs a collective: each rank adds
its pieces weighted so that one sum over every rank counts each weight and each token once
(`trainer/observe/layer_norms.py`), and `collect`, after the step, takes that sum and one
maximum over the world. So every layout reports the one-process values, and the sum of the
per-layer squared gradient norms is the squared `grad_norm`.

The cost is timed as the step region `stability` (`time_stability_s`, part of the forward and
optimizer times it sits in, and of the step time): on a sampled step about one more QK^T,
one more softmax over the logits, the norms and a copy of the weights; nothing otherwise.

The latest values (`latest`, by the names `logging.stability_alerts` takes) and the alerts
of the last sampled step (`alerts`, the same on every rank) are what `faults.on_alert` acts
on (`trainer/faults/step_guard.py`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from pretrain.trainer.observe.activation_probes import ActivationProbes
from pretrain.trainer.observe.layer_norms import LayerNorms, layer_groups
from pretrain.trainer.step.phases import StepPhases

PREFIX = "stability/"


@dataclass(frozen=True)
class Alert:
    """A sampled monitor above its threshold (or not finite)."""

    step: int
    name: str
    value: float
    threshold: float

    def line(self) -> str:
        """The warning line."""
        return (
            f"step {self.step}: {PREFIX}{self.name} = {self.value:.4g} is above its threshold "
            f"{self.threshold:g} (logging.stability_alerts.{self.name})"
        )


class StabilityMonitor:
    """Samples the monitors every `every` steps (0: never) and raises alerts."""

    def __init__(
        self,
        every: int,
        thresholds: dict[str, float],
        probes: ActivationProbes | None,
        *,
        n_layers: int,
        stage_ranks: int,
        device: torch.device,
        phases: StepPhases,
    ) -> None:
        self.every = every
        self.thresholds = thresholds
        self.probes = probes
        self.groups = layer_groups(n_layers)
        self.stage_ranks = stage_ranks
        self.device, self.phases = device, phases
        self.active = False
        self.latest: dict[str, float] = {}
        self.alerts: list[Alert] = []
        self._norms: dict[int, LayerNorms] = {}
        self._reset()

    def _reset(self) -> None:
        size = len(self.groups)
        self.grad_squares = torch.zeros(size, dtype=torch.float64)
        self.weight_squares = torch.zeros(size, dtype=torch.float64)
        self.change_squares = torch.zeros(size, dtype=torch.float64)
        self.measured = torch.zeros(2, dtype=torch.float64)  # gradients, updates

    def _layer_norms(self, view: nn.Module) -> LayerNorms:
        # PipeDream-2BW's state alternates between two views (weight versions).
        if id(view) not in self._norms:
            self._norms[id(view)] = LayerNorms(view, len(self.groups) - 2, self.stage_ranks)
        return self._norms[id(view)]

    def due(self, step: int) -> bool:
        """Whether `step` is sampled."""
        return self.every > 0 and step % self.every == 0

    def arm(self, step: int) -> None:
        """Before `step` runs: arm the monitors if it is sampled."""
        self.active = self.due(step)
        if self.active:
            self._reset()
            if self.probes is not None:
                self.probes.reset()
                self.probes.arm(True)

    def gradients(self, view: nn.Module) -> None:
        """The step's gradients are complete (unscaled, not yet clipped)."""
        if not self.active:
            return
        with self.phases.phase("stability", within=True):
            self.grad_squares = self._layer_norms(view).gradients()
            self.measured[0] = 1.0 / self.stage_ranks

    @contextlib.contextmanager
    def update(self, view: nn.Module, applied: bool) -> Iterator[None]:
        """Around the optimizer's update of `view`'s weights (`applied`: one is made)."""
        if not self.active:
            yield
            return
        norms = self._layer_norms(view)
        with self.phases.phase("stability", within=True):
            self.weight_squares = norms.weights_now()
            before = norms.snapshot() if applied else []
        yield
        if applied:
            with self.phases.phase("stability", within=True):
                self.change_squares = norms.changes(before)
                self.measured[1] = 1.0 / self.stage_ranks
        del before

    def collect(self, step: int) -> dict[str, float | None]:
        """After the step: the sampled metrics (collective over the world when sampled; {}
        otherwise), and `alerts` of the monitors above their thresholds."""
        self.alerts = []
        if not self.active:
            return {}
        self.active = False
        with self.phases.phase("stability"):
            if self.probes is not None:
                self.probes.arm(False)
            metrics, self.latest = self._reduce()
        for name, threshold in self.thresholds.items():
            value = self.latest.get(name)
            # A value that is not finite crosses every threshold.
            if threshold > 0 and value is not None and not value <= threshold:
                self.alerts.append(Alert(step, name, value, threshold))
        return metrics

    def _reduce(self) -> tuple[dict[str, float | None], dict[str, float]]:
        """The metrics (non-finite values as None) and the summaries by alert name (as
        they are) of the sums over the world."""
        probes = self.probes
        layers = len(self.groups) - 2
        parts = [self.grad_squares, self.weight_squares, self.change_squares, self.measured]
        if probes is not None:
            parts += [probes.act_squares.cpu(), probes.act_count.cpu(), probes.z_sums.cpu()]
        sums = torch.cat(parts).to(self.device)
        dist.all_reduce(sums)
        sums = sums.cpu()
        size = len(self.groups)
        grads, weights, changes = (sums[i * size : (i + 1) * size] for i in range(3))
        measured = sums[3 * size : 3 * size + 2]
        out: dict[str, float | None] = {}
        raw: dict[str, float] = {}
        if measured[0] > 0:
            _per_group(out, raw, "grad_norm", self.groups, grads.sqrt().tolist())
        _per_group(out, raw, "param_norm", self.groups, weights.sqrt().tolist())
        out[f"{PREFIX}param_norm"] = _finite(weights.sum().sqrt().item())
        if measured[1] > 0:
            ratios = (changes.sqrt() / weights.sqrt()).tolist()
            _per_group(out, raw, "update_ratio", self.groups, ratios)
        if probes is not None:
            rest = sums[3 * size + 2 :]
            squares, count, z = rest[:layers], rest[layers : 2 * layers], rest[2 * layers :]
            names = self.groups[1:-1]
            _per_group(out, raw, "act_rms", names, (squares / count).sqrt().tolist())
            top = probes.logit_max.clone().to(self.device)
            dist.all_reduce(top, dist.ReduceOp.MAX)
            _per_group(out, raw, "attn_logit", names, top.cpu().tolist())
            if z[1] > 0:
                raw["z_mean"] = (z[0] / z[1]).item()
                out[f"{PREFIX}z_mean"] = _finite(raw["z_mean"])
        return out, raw


def _finite(value: float) -> float | None:
    """A value for metrics.jsonl: non-finite ones are null."""
    return value if math.isfinite(value) else None


def _per_group(
    out: dict[str, float | None],
    raw: dict[str, float],
    monitor: str,
    groups: list[str],
    values: list[float],
) -> None:
    """stability/<monitor>/<group> of each group and stability/<monitor>_max, the largest
    (a NaN counts as infinite), into `out`; that largest as it is into `raw`."""
    out.update({f"{PREFIX}{monitor}/{g}": _finite(v) for g, v in zip(groups, values, strict=True)})
    worst = max((math.inf if math.isnan(v) else v for v in values), default=-math.inf)
    raw[f"{monitor}_max"] = worst
    out[f"{PREFIX}{monitor}_max"] = _finite(worst)


OFF = StabilityMonitor(
    0,
    {},
    None,
    n_layers=0,
    stage_ranks=1,
    device=torch.device("cpu"),
    phases=StepPhases(torch.device("cpu"), enabled=False),
)
"""A monitor that never samples: the default of a state no loop samples."""
