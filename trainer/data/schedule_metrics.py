"""What a batch-size ramp, a sequence-length warm-up and a mixture schedule add to the
metrics and the log: each step's own tokens and FLOPs (so a window's throughput and MFU are
those of the stage it ran), the step's global batch, seq_len and tokens trained, and the
start-up lines that list the phases.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pretrain.core.data_order.mixture import Mixture
from pretrain.core.data_order.ramps import Ramp
from pretrain.core.recompute import recomputed_blocks
from pretrain.core.schema import RecipeConfig
from pretrain.models.flops import flops_per_token


def step_work(cfg: RecipeConfig, ramp: Ramp) -> Callable[[int], tuple[int, float, float]]:
    """Tokens, model FLOPs and hardware FLOPs (with recomputation) of 0-based step k: its
    global batch of its seq_len, at the FLOPs per token of that length."""
    fraction = len(recomputed_blocks(cfg.recompute, cfg.model.n_layers)) / cfg.model.n_layers
    per_token: dict[int, tuple[float, float]] = {}

    def work(step: int) -> tuple[int, float, float]:
        phase = ramp.phase(step)
        if phase.seq_len not in per_token:
            flops = flops_per_token(cfg.model, phase.seq_len)
            per_token[phase.seq_len] = (
                flops.train,
                flops.with_recompute(cfg.recompute.policy, fraction, cfg.parallel.tp > 1),
            )
        model, hardware = per_token[phase.seq_len]
        tokens = phase.tokens_per_step
        return tokens, model * tokens, hardware * tokens

    return work


def ramp_metrics(ramp: Ramp, steps: int) -> dict[str, Any]:
    """The last of `steps` steps' global batch and seq_len, and the tokens trained through it
    (none without a ramp, where they never change)."""
    if not ramp.active or steps < 1:
        return {}
    phase = ramp.phase(steps - 1)
    return {
        "tokens": ramp.tokens_before(steps),
        "global_batch": phase.global_batch,
        "seq_len": phase.seq_len,
    }


def phase_lines(cfg: RecipeConfig, ramp: Ramp, labels: list[str]) -> list[str]:
    """One line per phase of the ramp and of the mixture schedule, as far as train.steps."""
    lines = []
    if ramp.active:
        for phase in ramp.within(cfg.train.steps):
            assert phase.steps is not None
            last = phase.first_step + phase.steps
            lines.append(
                f"steps {phase.first_step + 1}-{last}: global batch {phase.global_batch} x "
                f"seq_len {phase.seq_len} from {phase.tokens_before:,} tokens "
                "(the LR schedule runs by tokens)"
            )
    if cfg.data.mixture_schedule:
        mixture = Mixture([s.weight for s in cfg.data.sources], ramp, cfg.data.mixture_schedule)
        for i, phase in enumerate(cfg.data.mixture_schedule):
            step = ramp.first_step_at(phase.from_tokens)
            if step >= cfg.train.steps:
                lines.append(f"mixture phase {phase.name or i}: not reached by train.steps")
                continue
            shares = ", ".join(
                f"{label} {float(q):.3g}"
                for label, q in zip(labels, mixture.shares(step), strict=True)
            )
            how = ", blending into the next" if phase.blend else ""
            lines.append(f"mixture phase {phase.name or i} from step {step + 1}: {shares}{how}")
    return lines
