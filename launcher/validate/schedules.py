"""Rules of the schedules over the run: the LR schedule fitted to a short run, the
batch-size ramp and the sequence-length warm-up (`train.batch_schedule`,
`train.seq_len_schedule`) and the mixture's phases (`data.mixture_schedule`).

Short runs made to fit: `pretrain train.steps=5` is the first smoke test a newcomer types;
refusing it because the recipe's warmup is 20 steps helps nobody. The launcher shortens the
warmup (and a decay that no longer fits after it) to the run's length (under a ramp, its
tokens in full steps, which the LR schedule counts), says so, and writes the shortened
values to config.yaml, so the ranks train exactly what the warning says.

A ramp's thresholds and values only grow, and every stage stays below the recipe's own
value, which is the last stage (what the plan's memory and the dry run size). Every rule the
recipe's global batch or seq_len must pass, each stage's must pass too (the layout divides
its batch, the pipeline fills with it, cp, sp, the loss chunks and FP8 split its sequences):
each stage is validated as the recipe with its value, and what it alone breaks is reported
at the stage's field. A step of short sequences reads whole sequences of the data order, and
PipeDream-2BW, whose pipeline stays full across steps, takes no ramp.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence

from pretrain.core.data_order.ramps import Ramp
from pretrain.core.problems import Checks, Problem, divisors, or_list, show_value
from pretrain.core.schedules import SCHEDULES
from pretrain.core.schema import RecipeConfig

ProblemsOf = Callable[[RecipeConfig], list[Problem]]
"""Every problem `validate` finds in a recipe (a recipe without schedules)."""


def check_schedules(c: Checks, cfg: RecipeConfig, problems_of: ProblemsOf | None) -> None:
    """The ramp's and the mixture schedule's rules; `problems_of` validates a stage (None:
    the recipe's own batch, model or cluster are too broken to validate stages against)."""
    ramp_ok = _check_batch_stages(c, cfg) & _check_seq_len_stages(c, cfg)
    _check_mixture_phases(c, cfg)
    t = cfg.train
    if not (t.batch_schedule or t.seq_len_schedule) or not ramp_ok:
        return
    p = cfg.parallel
    if p.pp > 1 and SCHEDULES.get(p.pp_schedule) and not SCHEDULES[p.pp_schedule].flushes:
        c.add("parallel.pp_schedule", p.pp_schedule, f"{p.pp_schedule} keeps its pipeline full "
              "across optimizer steps, so a step's micro-batches cannot change between "
              "stages of train.batch_schedule or train.seq_len_schedule", "use a schedule "
              "that flushes every step (1f1b, interleaved_1f1b, ...), or no ramp")  # fmt: skip
    if problems_of is not None:
        _check_each_stage(c, cfg, problems_of)
    try:
        ramp = Ramp(cfg.train)
    except ValueError:
        _whole_sequences(c, cfg)
        return
    _check_lr_by_tokens(c, cfg, ramp)


def _increasing(c: Checks, at: str, values: Sequence[int], what: str) -> bool:
    """Each of `values` (the field `what` of the entries under `at`) above the one before."""
    for i in range(1, len(values)):
        if values[i] <= values[i - 1]:
            c.add(f"{at}[{i}].{what}", values[i], f"not above the one before "
                  f"({values[i - 1]}): a schedule's {what} only grows",
                  f"list the stages in order, each {what} above the last")  # fmt: skip
            return False
    return True


def _check_batch_stages(c: Checks, cfg: RecipeConfig) -> bool:
    """Positive, growing batches below train.global_batch at growing thresholds."""
    stages, full = cfg.train.batch_schedule, cfg.train.global_batch
    at = "train.batch_schedule"
    ok = all(
        [c.at_least(f"{at}[{i}].global_batch", s.global_batch, 1) for i, s in enumerate(stages)]
        + [c.at_least(f"{at}[{i}].until_tokens", s.until_tokens, 1) for i, s in enumerate(stages)]
    )
    ok = ok and _increasing(c, at, [s.global_batch for s in stages], "global_batch")
    ok = ok and _increasing(c, at, [s.until_tokens for s in stages], "until_tokens")
    if ok and stages and stages[-1].global_batch >= full:
        c.add(f"{at}[{len(stages) - 1}].global_batch", stages[-1].global_batch,
              f"not below train.global_batch={full}, the batch after the last stage (the "
              "largest, which the plan sizes)", f"use stages below {full}, or raise "
              "train.global_batch")  # fmt: skip
        ok = False
    return ok


def _check_seq_len_stages(c: Checks, cfg: RecipeConfig) -> bool:
    """Positive, growing divisors of train.seq_len below it at growing thresholds."""
    stages, full = cfg.train.seq_len_schedule, cfg.train.seq_len
    at = "train.seq_len_schedule"
    ok = all(
        [c.at_least(f"{at}[{i}].seq_len", s.seq_len, 1) for i, s in enumerate(stages)]
        + [c.at_least(f"{at}[{i}].until_tokens", s.until_tokens, 1) for i, s in enumerate(stages)]
    )
    if not ok or full < 1:
        return False
    for i, s in enumerate(stages):
        if s.seq_len >= full or full % s.seq_len:
            shorter = [d for d in divisors(full) if d < full][-3:]
            c.add(f"{at}[{i}].seq_len", s.seq_len, f"not a divisor of train.seq_len={full} "
                  "below it: each full-length sequence of the data order is cut into equal "
                  "pieces of the stage's length", f"use {or_list(shorter) or 'none'}, or "
                  "raise train.seq_len")  # fmt: skip
            ok = False
    ok = ok and _increasing(c, at, [s.seq_len for s in stages], "seq_len")
    return ok and _increasing(c, at, [s.until_tokens for s in stages], "until_tokens")


def _without_schedules(cfg: RecipeConfig) -> RecipeConfig:
    stage = copy.deepcopy(cfg)
    stage.train.batch_schedule = []
    stage.train.seq_len_schedule = []
    stage.data.mixture_schedule = []
    return stage


def _check_each_stage(c: Checks, cfg: RecipeConfig, problems_of: ProblemsOf) -> None:
    """Every stage passes the rules its field passes at the recipe's value: what the
    recipe validated with the stage's value finds beyond the recipe's own problems is the
    stage's."""
    base = _without_schedules(cfg)
    known = {str(p) for p in problems_of(base)}
    stages = [("train.batch_schedule", i, "global_batch", s.global_batch)
              for i, s in enumerate(cfg.train.batch_schedule)]  # fmt: skip
    stages += [("train.seq_len_schedule", i, "seq_len", s.seq_len)
               for i, s in enumerate(cfg.train.seq_len_schedule)]  # fmt: skip
    for at, i, name, value in stages:
        stage = copy.deepcopy(base)
        setattr(stage.train, name, value)
        for problem in problems_of(stage):
            if str(problem) in known:
                continue
            reason = problem.reason
            if problem.field != f"train.{name}":
                reason = f"at this stage {problem.field}={show_value(problem.value)}: {reason}"
            c.add(f"{at}[{i}].{name}", value, reason, problem.fix)


def _whole_sequences(c: Checks, cfg: RecipeConfig) -> None:
    """A step of short sequences reads whole full-length sequences of the data order: the
    first phase that does not is named."""
    t = cfg.train
    tokens = 0
    thresholds = sorted({s.until_tokens for s in t.batch_schedule + t.seq_len_schedule})
    for start in [0, *thresholds]:
        tokens = max(tokens, start)
        batch = next((s.global_batch for s in t.batch_schedule if tokens < s.until_tokens),
                     t.global_batch)  # fmt: skip
        stage = next((i for i, s in enumerate(t.seq_len_schedule) if tokens < s.until_tokens),
                     None)  # fmt: skip
        if stage is None:
            return
        length = t.seq_len_schedule[stage].seq_len
        if batch * length % t.seq_len:
            pieces = t.seq_len // length
            c.add(f"train.seq_len_schedule[{stage}].seq_len", length, f"cuts each sequence of "
                  f"the data order into {pieces} pieces, and a global batch of {batch} at "
                  f"{tokens:,} tokens is not a whole number of them ({batch} / {pieces})",
                  f"use global batches that are multiples of {pieces} while seq_len is "
                  f"{length} (train.batch_schedule)")  # fmt: skip
            return


def _check_lr_by_tokens(c: Checks, cfg: RecipeConfig, ramp: Ramp) -> None:
    """Under a ramp the LR schedule counts full steps' worth of tokens: its warmup and decay
    must fit in the run's."""
    s, steps = cfg.schedule, cfg.train.steps
    if steps < 1 or s.warmup_steps < 0 or s.decay_steps < 0:
        return
    full = ramp.full_steps(steps)
    tokens = cfg.train.global_batch * cfg.train.seq_len
    if s.warmup_steps + s.decay_steps > full:
        field = "schedule.warmup_steps" if s.warmup_steps > full else "schedule.decay_steps"
        c.add(field, getattr(s, field.split(".")[1]), f"under the ramp the LR schedule runs by "
              f"tokens, in full steps of {tokens:,} (train.global_batch x seq_len), and the run's "
              f"{ramp.tokens_before(steps):,} tokens make {full:.4g} of them", "use warmup_steps "
              f"+ decay_steps <= {math.floor(full)}, or more train.steps")  # fmt: skip


def _check_mixture_phases(c: Checks, cfg: RecipeConfig) -> None:
    """Phases over data.sources: one weight each (>= 0, not all 0), from 0 tokens on in
    growing order, and no blend after the last."""
    phases, sources = cfg.data.mixture_schedule, cfg.data.sources
    at = "data.mixture_schedule"
    if not phases:
        return
    if not sources:
        c.add(at, f"{len(phases)} phase(s)", "schedules the weights of data.sources, and none "
              "are given", "list the sources in data.sources, or drop the schedule")  # fmt: skip
        return
    for i, phase in enumerate(phases):
        weights = phase.weights
        if len(weights) != len(sources):
            c.add(f"{at}[{i}].weights", weights, f"{len(weights)} weights for "
                  f"{len(sources)} sources (data.sources)", "give one weight per source, in "
                  "the order of data.sources")  # fmt: skip
        elif not all(math.isfinite(w) and w >= 0 for w in weights) or sum(weights) <= 0:
            c.add(
                f"{at}[{i}].weights",
                weights,
                "weights must be finite, >= 0 and not all 0",
                "give each source its share, e.g. [0.7, 0.3] (0 leaves a source out)",
            )
    if phases[0].from_tokens != 0:
        c.add(f"{at}[0].from_tokens", phases[0].from_tokens, "the first phase sets the shares "
              "from the first step on", "use 0")  # fmt: skip
    _increasing(c, at, [p.from_tokens for p in phases], "from_tokens")
    if phases[-1].blend:
        c.add(f"{at}[{len(phases) - 1}].blend", True, "the last phase has no next phase to "
              "blend into", "set blend=false on the last phase")  # fmt: skip
    names = [p.name for p in phases if p.name]
    for name in names:
        if names.count(name) > 1:
            c.add(f"{at}[{[p.name for p in phases].index(name)}].name", name, "names two "
                  "phases", "give each phase its own name")  # fmt: skip
            return


def fit_schedule_to_run(cfg: RecipeConfig) -> list[str]:
    """Shorten `cfg`'s warmup and decay to `train.steps` (under a ramp, to the run's tokens
    in full steps, which the LR schedule counts) where they are longer; one warning per
    change. Values that are invalid on their own are left for the validator."""
    s, steps = cfg.schedule, cfg.train.steps
    if steps < 1 or s.warmup_steps < 0 or s.decay_steps < 0:
        return []
    length, what = steps, f"train.steps={steps}"
    if cfg.train.batch_schedule or cfg.train.seq_len_schedule:
        try:
            length = max(1, math.floor(Ramp(cfg.train).full_steps(steps)))
        except (ValueError, ArithmeticError):
            return []  # a ramp the validator refuses
        what = f"the run's {length} full steps of tokens (the LR schedule's unit under the ramp)"
    warnings = []
    if s.warmup_steps > length:
        warnings.append(
            f"schedule.warmup_steps={s.warmup_steps} is longer than {what}; "
            f"warming up over all {length} steps instead"
        )
        s.warmup_steps = length
    if s.warmup_steps + s.decay_steps > length:
        fitted = length - s.warmup_steps
        warnings.append(
            f"schedule.warmup_steps + decay_steps = {s.warmup_steps + s.decay_steps} is longer "
            f"than {what}; decaying over the remaining {fitted} steps instead"
        )
        s.decay_steps = fitted
    return warnings
