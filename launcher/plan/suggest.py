"""Layout search (`action=suggest`): every layout of the recipe's model on its cluster that the
memory model predicts to fit, ranked by the cost model's step time (`pretrain.launcher.plan.cost`).

The recipe gives the model, the cluster shape (cluster.nodes x cluster.gpus_per_node of
cluster.gpu_type), precision, optimizer and train.global_batch / seq_len; its own parallel
layout and micro-batch are ignored. The search spans:

- tp: divisors of the query and key/value heads that also divide gpus_per_node (TP stays in
  a node), with SP whenever tp > 1 (same traffic as TP's all-reduces, less memory);
- pp: every degree that tiles the cluster with at least one layer per stage, and vpp >= 2
  (interleaved 1F1B) up to MAX_VPP and one layer per chunk, one per distinct chunk size; where the
  stages do not divide the layers, Megatron's uneven split (`stages.balanced_split`: the
  first and last stage, which also hold the embedding and the head, get fewer);
- ZeRO 0-3, and hybrid sharding (dp_replicate > 1) where a node holds a whole shard group
  and the dp group would otherwise leave the node;
- recompute none, selective or full (every block); micro-batches dividing the per-rank batch;
- from CP_FROM tokens on, context parallelism: cp up to MAX_CP dividing the data-parallel
  ranks, the ring inside a node or across nodes (the cost model prices the link it crosses);
- for MoE models, expert parallelism: every ep dividing both the data-parallel ranks and
  the experts.

Ties in step time go to less traffic, then to more memory headroom. For long sequences each
suggestion's reasons walk the long-context levers in the seeds' order (recompute, then SP,
then CP, then a smaller micro-batch: cheapest first) and say which this layout pulls, and
for a cp > 1 layout the peak the same layout would reach without it.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TextIO

from pretrain.core import hardware
from pretrain.core.hardware import GIB, Links
from pretrain.core.layout import Degrees
from pretrain.core.problems import Problem, RecipeError, divisors
from pretrain.core.schedules import default_schedule
from pretrain.core.schema import RecipeConfig
from pretrain.core.stages import balanced_split
from pretrain.launcher.plan.calibrated import calibrated_device, calibration_note
from pretrain.launcher.plan.compute import Kernels
from pretrain.launcher.plan.cost import (
    StepCost,
    assumptions,
    predicted_mfu,
    recipe_links,
    step_cost,
    with_recipe_links,
)
from pretrain.launcher.plan.memory import MemoryBreakdown, peak_breakdown, state_floor
from pretrain.launcher.plan.memory_fit import device_memory_gib
from pretrain.launcher.plan.plan import LONG_CONTEXT
from pretrain.launcher.validate.layout import check_runnable
from pretrain.launcher.validate.recipe import validate

RECOMPUTE_POLICIES = ("none", "selective", "full")
HEADROOM = 0.05
"""Share of device memory a suggested layout leaves free beyond the predicted peak (which
already counts the framework allowance): a margin for the memory model's error."""
LAYOUT_FIELDS = ("parallel.", "train.global_batch", "train.micro_batch")
"""Problems on these fields depend on the layout, which the search chooses."""
MAX_VPP = 8
"""Most virtual stages per rank the search tries: each adds a send per micro-batch while
the bubble it removes shrinks as 1/vpp."""
CP_FROM = 8192
"""Sequences from this length on try context parallelism (issue 25 cites a published 405B
run at TP8 CP2 and 8k tokens; Llama 3 405B's 128k phase ran CP16: Dubey et al. 2024,
Table 4)."""
MAX_CP = 16
"""Largest cp the search tries (the Llama 3 long-context phase's)."""


@dataclass(frozen=True)
class Layout:
    """One point of the search: the recipe fields it sets."""

    tp: int
    sp: bool
    pp: int
    vpp: int
    dp_replicate: int
    dp_shard: int
    zero: int
    recompute: str
    micro_batch: int
    pp_layers: tuple[int, ...] = ()
    """Layers per stage when the stages do not divide them; () for an even split."""
    cp: int = 1
    ep: int = 1

    @property
    def pp_schedule(self) -> str:
        return default_schedule(self.vpp)

    def overrides(self) -> list[str]:
        """The Hydra overrides that give a recipe this layout."""
        return [
            f"parallel.tp={self.tp}",
            f"parallel.sp={str(self.sp).lower()}",
            f"parallel.cp={self.cp}",
            f"parallel.ep={self.ep}",
            f"parallel.pp={self.pp}",
            f"parallel.vpp={self.vpp}",
            f"parallel.pp_schedule={self.pp_schedule}",
            f"parallel.pp_layers=[{','.join(map(str, self.pp_layers))}]",
            "parallel.pp_microbatches=0",
            f"parallel.dp_replicate={self.dp_replicate}",
            f"parallel.dp_shard={self.dp_shard}",
            f"parallel.zero={self.zero}",
            f"recompute.policy={self.recompute}",
            "recompute.every=1",
            f"train.micro_batch={self.micro_batch}",
        ]

    def apply(self, cfg: RecipeConfig) -> RecipeConfig:
        """A copy of `cfg` with this layout (the nested configs it touches are copied)."""
        parallel = dataclasses.replace(
            cfg.parallel,
            tp=self.tp,
            sp=self.sp,
            cp=self.cp,
            ep=self.ep,
            pp=self.pp,
            vpp=self.vpp,
            pp_schedule=self.pp_schedule,
            pp_layers=list(self.pp_layers),
            pp_microbatches=0,
            dp_replicate=self.dp_replicate,
            dp_shard=self.dp_shard,
            zero=self.zero,
        )
        recompute = dataclasses.replace(cfg.recompute, policy=self.recompute, every=1)
        train = dataclasses.replace(cfg.train, micro_batch=self.micro_batch)
        return dataclasses.replace(cfg, parallel=parallel, recompute=recompute, train=train)


@dataclass(frozen=True)
class Suggestion:
    """A layout that fits, with its estimated cost and predicted memory."""

    layout: Layout
    cost: StepCost
    memory: MemoryBreakdown
    device_gib: float
    tokens_per_s: float
    mfu: float
    runnable: bool
    """Whether this version's trainer executes the layout (else it can only be planned)."""
    long_context: str = ""
    """For long sequences: the long-context levers in order, and which this layout pulls."""

    @property
    def headroom_gib(self) -> float:
        return self.device_gib - self.memory.total_gib

    def why(self) -> str:
        """The dominant cost terms and the memory headroom, in one line."""
        total = self.cost.total
        terms = sorted(self.cost.terms().items(), key=lambda kv: -kv[1])
        shown = [
            f"{name} {sec:.2f} s ({sec / total:.0%})" for name, sec in terms if sec > 0.005 * total
        ]
        hidden = self.cost.dp_total - self.cost.dp_exposed
        if hidden >= 0.005:
            shown.append(f"dp {hidden:.2f} s hidden")
        biggest = max(self.memory.rows(), key=lambda row: row[1])
        return (
            ", ".join(shown)
            + f"; peak {self.memory.total_gib:.1f} GiB ({biggest[0]} {biggest[1] / GIB:.1f}), "
            f"{self.headroom_gib:.1f} GiB headroom"
        )


Scored = list[tuple[tuple[float, float, float], Layout, Suggestion]]
"""Layouts that fit, each with its sort key (step time, traffic, -memory) and suggestion."""


@dataclass
class Search:
    """The result of a search: the best suggestions and what was searched."""

    suggestions: list[Suggestion]
    enumerated: int
    fitting: int
    device_gib: float
    peak_tflops: float
    assumptions: list[str]
    ranked: list[Suggestion] = dataclasses.field(default_factory=list)
    """Every layout that fits, fastest first (not validated): where a given layout ranks."""


def layouts(cfg: RecipeConfig) -> Iterator[Layout]:
    """Every layout of the search space that tiles the cluster and the global batch."""
    m, k = cfg.model, cfg.cluster
    world, gpn = k.nodes * k.gpus_per_node, k.gpus_per_node
    for tp in divisors(math.gcd(m.n_heads, m.kv_heads)):
        if gpn % tp:
            continue
        sp = tp > 1 and cfg.train.seq_len % tp == 0
        for pp, cp in _pipelines_and_rings(cfg, tp):
            dp = world // (tp * pp * cp)
            if cfg.train.global_batch % dp:
                continue
            per_rank = cfg.train.global_batch // dp
            # Without data parallelism every ZeRO stage is the same layout.
            zeros = range(4) if dp > 1 else range(1)
            for vpp, zero, recompute, micro in _product(
                _vpps(m.n_layers, pp), zeros, divisors(per_rank)
            ):
                micro_batches = per_rank // micro
                if pp > 1 and (micro_batches < pp or (vpp > 1 and micro_batches % pp)):
                    continue
                split = balanced_split(m.n_layers, pp * vpp)
                uneven = tuple(split) if len(set(split)) > 1 else ()
                for replicate, ep in itertools.product(
                    _replicas(zero, tp, dp * cp, gpn), _eps(cfg, dp)
                ):
                    if replicate > 1 and dp % replicate:
                        continue
                    shard = dp // replicate
                    yield Layout(
                        tp, sp, pp, vpp, replicate, shard, zero, recompute, micro, uneven, cp, ep
                    )


def _eps(cfg: RecipeConfig, dp: int) -> list[int]:
    """ep degrees to try: the recipe's for a dense model, else every one dividing dp and
    the experts."""
    if not cfg.model.moe_experts:
        return [1]
    return divisors(math.gcd(dp, cfg.model.moe_experts))


def _pipelines_and_rings(cfg: RecipeConfig, tp: int) -> Iterator[tuple[int, int]]:
    """(pp, cp) pairs that tile the world with tp, at least one layer per stage: cp > 1 only
    from CP_FROM tokens, up to MAX_CP, with 2cp chunks of the sequence (split over tp under
    SP); the ring may leave the node."""
    k, seq = cfg.cluster, cfg.train.seq_len
    world = k.nodes * k.gpus_per_node
    rings = [1]
    if seq >= CP_FROM:
        rings += [c for c in divisors(world // tp) if 1 < c <= MAX_CP and seq % (2 * c * tp) == 0]
    for pp in divisors(world // tp):
        if pp > cfg.model.n_layers:
            continue
        for cp in rings:
            if (world // tp) % (pp * cp) == 0:
                yield pp, cp


def _vpps(n_layers: int, pp: int) -> list[int]:
    """1, and with pp > 1 every vpp up to MAX_VPP whose chunks hold a layer count no
    smaller vpp gives (ceil(n / (pp vpp)), at least one)."""
    if pp == 1:
        return [1]
    chosen, sizes = [1], {-(-n_layers // pp)}
    for vpp in range(2, min(MAX_VPP, n_layers // pp) + 1):
        size = -(-n_layers // (pp * vpp))
        if size not in sizes:
            chosen.append(vpp)
            sizes.add(size)
    return chosen


def _product(vpps: list[int], zeros: range, micros: list[int]) -> Iterator[tuple]:
    for vpp in vpps:
        for zero in zeros:
            for recompute in RECOMPUTE_POLICIES:
                for micro in micros:
                    yield vpp, zero, recompute, micro


def _replicas(zero: int, tp: int, dp: int, gpn: int) -> list[int]:
    """dp_replicate options: 1, and under ZeRO >= 1 one shard group per node when dp spans
    nodes (sharding traffic stays on NVLink, only the replicas' all-reduce leaves)."""
    per_node = gpn // tp
    if zero >= 1 and dp > per_node > 1 and dp % per_node == 0:
        return [1, dp // per_node]
    return [1]


def degrees_of(layout: Layout, cfg: RecipeConfig) -> Degrees:
    """The resolved degrees of `layout` on `cfg`'s cluster."""
    world = cfg.cluster.nodes * cfg.cluster.gpus_per_node
    return Degrees(
        layout.pp,
        layout.dp_replicate,
        layout.dp_shard,
        layout.tp,
        layout.ep,
        world,
        layout.cp,
    )


def search(cfg: RecipeConfig, top: int | None = None) -> Search:
    """The `top` (default `suggest.top`) fastest layouts of `cfg` that fit, each validated.

    Raises RecipeError for problems of the recipe that no layout changes, or when nothing fits.
    """
    top = cfg.suggest.top if top is None else top
    _check_searchable(cfg)
    spec = hardware.gpu_spec(cfg.cluster.gpu_type)
    links = recipe_links(cfg, spec.name)
    peak = cfg.hardware.peak_tflops or spec.peak_tflops[cfg.precision.dtype]
    limit = device_memory_gib(cfg)
    # _check_searchable admits CUDA devices only, and every GPU of the table has links.
    assert links is not None and limit is not None
    kernels = None
    notes = []
    calibrated = calibrated_device(cfg)
    if calibrated is not None:
        kernels, measured, found = calibrated
        links = with_recipe_links(cfg, measured)
        notes.append(f"rates: {calibration_note(found)}")
    scored, enumerated, _ = _evaluate(cfg, peak, links, limit, prune=True, kernels=kernels)
    if not scored:
        # Every family was judged in full, so the smallest peak named is the true one.
        _, _, smallest = _evaluate(cfg, peak, links, limit, prune=False, kernels=kernels)
        peak_gib, closest = smallest if smallest else (0.0, None)
        raise RecipeError(
            [
                Problem(
                    "cluster.nodes",
                    cfg.cluster.nodes,
                    f"no layout of {enumerated} fits the {limit:g} GiB of {spec.name} with "
                    f"{HEADROOM:.0%} headroom; the "
                    f"smallest predicted peak is {peak_gib:.1f} GiB"
                    + (f" ({' '.join(closest.overrides())})" if closest else ""),
                    "add nodes, use a GPU with more memory, or lower train.seq_len",
                )
            ]
        )
    scored.sort(key=lambda item: item[0])

    chosen: list[Suggestion] = []
    for _, layout, suggestion in scored:
        candidate = layout.apply(cfg)
        try:
            validate(candidate)
        except RecipeError:
            continue  # the search space should hold only valid layouts; never suggest one
        runnable = not check_runnable(candidate)
        note = long_context_note(cfg, layout, limit)
        chosen.append(dataclasses.replace(suggestion, runnable=runnable, long_context=note))
        if len(chosen) == top:
            break
    return Search(
        suggestions=chosen,
        enumerated=enumerated,
        fitting=len(scored),
        device_gib=limit,
        peak_tflops=peak,
        assumptions=[*assumptions(spec.name, links, peak, cfg.precision.dtype, kernels), *notes],
        ranked=[suggestion for _, _, suggestion in scored],
    )


def long_context_note(cfg: RecipeConfig, layout: Layout, limit: float) -> str:
    """The seeds' long-context decision order (recompute, then SP, then CP, then a smaller
    micro-batch: cheapest first) and which levers `layout` pulls; for cp > 1, the peak the
    same layout would reach with its cp ranks turned into data-parallel ones. Empty for
    sequences shorter than LONG_CONTEXT."""
    if cfg.train.seq_len < LONG_CONTEXT:
        return ""
    levers = [
        ("recompute", layout.recompute != "none", f"recompute={layout.recompute}"),
        ("SP", layout.sp, "sp"),
        ("CP", layout.cp > 1, f"cp={layout.cp}"),
        (
            "smaller micro-batch",
            layout.micro_batch < cfg.train.micro_batch,
            f"micro_batch={layout.micro_batch}",
        ),
    ]
    pulled = [setting for _, used, setting in levers if used] or ["none needed"]
    note = (
        f"{cfg.train.seq_len} tokens; levers cheapest first: "
        + ", then ".join(name for name, _, _ in levers)
        + f"; this layout: {', '.join(pulled)}"
    )
    if layout.cp > 1:
        without = dataclasses.replace(layout, cp=1, dp_shard=layout.dp_shard * layout.cp)
        degrees = degrees_of(without, cfg)
        microbatches = cfg.train.global_batch // (layout.micro_batch * degrees.dp)
        peak = peak_breakdown(without.apply(cfg), degrees, microbatches).total_gib
        verdict = "does not fit" if peak > limit * (1 - HEADROOM) else "fits, slower"
        note += f"; with cp=1 the peak would be {peak:.1f} GiB ({verdict})"
    return note


def _evaluate(
    cfg: RecipeConfig,
    peak: float,
    links: Links,
    limit: float,
    prune: bool,
    kernels: Kernels | None = None,
) -> tuple[Scored, int, tuple[float, Layout] | None]:
    """(the layouts that fit with their sort keys, how many were enumerated, the smallest
    peak of those that do not). With `prune`, a family of layouts (all but micro-batch and
    recompute alike) whose parameters and optimizer states alone overflow is skipped."""
    budget = limit * (1 - HEADROOM)
    scored: Scored = []
    floors: dict[tuple, float] = {}
    enumerated = 0
    smallest: tuple[float, Layout] | None = None
    for layout in layouts(cfg):
        enumerated += 1
        degrees = degrees_of(layout, cfg)
        family = (
            layout.tp,
            layout.cp,
            layout.ep,
            layout.pp,
            layout.vpp,
            layout.zero,
            layout.dp_replicate,
        )
        if prune and family not in floors:
            floors[family] = state_floor(layout.apply(cfg), degrees) / GIB
        if prune and floors[family] > budget:
            continue
        suggestion, memory = judge(cfg, layout, peak, links, limit, kernels)
        if suggestion is None:
            if smallest is None or memory.total_gib < smallest[0]:
                smallest = (memory.total_gib, layout)
            continue
        scored.append(
            (
                (suggestion.cost.total, suggestion.cost.communication, -memory.total),
                layout,
                suggestion,
            )
        )
    return scored, enumerated, smallest


def judge(
    cfg: RecipeConfig,
    layout: Layout,
    peak: float,
    links: Links,
    limit: float,
    kernels: Kernels | None = None,
) -> tuple[Suggestion | None, MemoryBreakdown]:
    """`layout` of `cfg` costed as the search costs it (None when it does not fit the
    `limit` GiB with HEADROOM), and its peak memory; `kernels` defaults to the GPU
    table's."""
    candidate, degrees = layout.apply(cfg), degrees_of(layout, cfg)
    micro_batches = cfg.train.global_batch // (layout.micro_batch * degrees.dp)
    memory = peak_breakdown(candidate, degrees, micro_batches)
    if memory.total_gib > limit * (1 - HEADROOM):
        return None, memory
    cost = step_cost(candidate, degrees, micro_batches, peak, links, kernels)
    tokens = cfg.train.global_batch * cfg.train.seq_len
    suggestion = Suggestion(
        layout=layout,
        cost=cost,
        memory=memory,
        device_gib=limit,
        tokens_per_s=tokens / cost.total,
        mfu=predicted_mfu(candidate, cost.total, peak),
        runnable=False,
    )
    return suggestion, memory


def _check_searchable(cfg: RecipeConfig) -> None:
    """Raise RecipeError for the recipe's problems that no layout fixes, and for a device
    the cost model has no figures for."""
    problems = []
    base = Layout(1, False, 1, 1, 1, -1, 0, "none", 1).apply(cfg)
    try:
        validate(base)
    except RecipeError as error:
        problems = [p for p in error.problems if not p.field.startswith(LAYOUT_FIELDS)]
    spec = hardware.GPUS.get(cfg.cluster.gpu_type)
    if cfg.cluster.device != "cuda":
        problems.append(
            Problem(
                "cluster.device",
                cfg.cluster.device,
                "the layout search ranks layouts by GPU peak FLOP/s, memory and link bandwidth",
                "set cluster.device=cuda and cluster.gpu_type to the cluster's GPU",
            )
        )
    elif spec is not None and not (
        cfg.hardware.peak_tflops or spec.peak_tflops.get(cfg.precision.dtype)
    ):
        problems.append(
            Problem(
                "hardware.peak_tflops",
                cfg.hardware.peak_tflops,
                f"{spec.name} has no {cfg.precision.dtype} peak in the GPU table",
                "set hardware.peak_tflops to the device's dense peak",
            )
        )
    if problems:
        raise RecipeError(problems)


def suggestion_to_dict(suggestion: Suggestion) -> dict:
    """One suggestion as plain JSON data (seconds, bytes and GiB)."""
    memory = {name: size for name, size, _ in suggestion.memory.rows()}
    return {
        **dataclasses.asdict(suggestion.layout),
        "pp_schedule": suggestion.layout.pp_schedule,
        "overrides": suggestion.layout.overrides(),
        "step_time_s": suggestion.cost.total,
        "tokens_per_s": suggestion.tokens_per_s,
        "mfu": suggestion.mfu,
        "cost_s": {**suggestion.cost.terms(), "dp_total": suggestion.cost.dp_total},
        "summary_s": three_terms(suggestion.cost),
        "memory": {**memory, "total": suggestion.memory.total},
        "peak_gib": suggestion.memory.total_gib,
        "headroom_gib": suggestion.headroom_gib,
        "runnable": suggestion.runnable,
        "why": suggestion.why(),
        "long_context": suggestion.long_context,
    }


def search_to_dict(cfg: RecipeConfig, result: Search) -> dict:
    """The whole search as plain JSON data."""
    k = cfg.cluster
    return {
        "name": cfg.name,
        "world": k.nodes * k.gpus_per_node,
        "nodes": k.nodes,
        "gpus_per_node": k.gpus_per_node,
        "gpu_type": k.gpu_type,
        "device_memory_gib": result.device_gib,
        "peak_tflops": result.peak_tflops,
        "enumerated": result.enumerated,
        "fitting": result.fitting,
        "assumptions": result.assumptions,
        "suggestions": [suggestion_to_dict(s) for s in result.suggestions],
    }


def render_search(cfg: RecipeConfig, result: Search, stream: TextIO | None = None) -> str:
    """The suggestions as a table rendered for `stream` (launcher/tables.py), then each
    one's step time in three terms, its why and the overrides to use it."""
    from pretrain.launcher.tables import new_table, render

    k, t = cfg.cluster, cfg.train
    heading = (
        f"Layouts for {cfg.name} on {k.nodes} x {k.gpus_per_node} {k.gpu_type} "
        f"({result.device_gib:g} GiB), global batch {t.global_batch} x {t.seq_len} tokens, "
        f"{cfg.precision.dtype}\n"
        f"{result.fitting} of {result.enumerated} layouts fit with {HEADROOM:.0%} headroom; the "
        "fastest by estimated step time (launcher/plan/cost.py):"
    )
    numbers = ("#", "tp", "sp", "pp", "vpp", "dp (rep x shard)", "zero")
    table = new_table(
        *((c, "right") for c in numbers),
        "recompute",
        *((c, "right") for c in ("mb", "step s", "tok/s", "MFU", "peak GiB")),
    )
    for i, s in enumerate(result.suggestions, 1):
        lay = s.layout
        table.add_row(
            str(i), str(lay.tp), "on" if lay.sp else "-", str(lay.pp), str(lay.vpp),
            f"{lay.dp_replicate * lay.dp_shard} ({lay.dp_replicate} x {lay.dp_shard})",
            str(lay.zero), lay.recompute, str(lay.micro_batch), f"{s.cost.total:.2f}",
            f"{s.tokens_per_s:,.0f}", f"{s.mfu:.0%}", f"{s.memory.total_gib:.1f}",
        )  # fmt: skip
    lines = [render(table, stream, heading)]
    for i, s in enumerate(result.suggestions, 1):
        lines += ["", f"#{i}", *_details(s)]
    lines += ["", "cost model:"] + [f"  - {line}" for line in result.assumptions]
    return "\n".join(lines)


def _details(s: Suggestion) -> list[str]:
    """What a table row cannot hold: the step in three terms, why, the split, how to use."""
    lay = s.layout
    terms = three_terms(s.cost)
    lines = [
        f"   step: compute {terms['compute']:.2f} s + exposed communication "
        f"{terms['exposed communication']:.2f} s + bubble {terms['bubble']:.2f} s"
        + (f"; tp {lay.tp} cp {lay.cp} ep {lay.ep}" if lay.cp > 1 or lay.ep > 1 else ""),
        f"   why: {s.why()}",
    ]
    if lay.pp_layers:
        lines.append(f"   stages: {split_text(lay.pp_layers)} layers (parallel.pp_layers)")
    if s.long_context:
        lines.append(f"   long context: {s.long_context}")
    lines.append(f"   use: {' '.join(lay.overrides())}")
    if not s.runnable:
        lines.append("   (this trainer version can only plan this layout: action=plan)")
    return lines


def three_terms(cost: StepCost) -> dict[str, float]:
    """A step's seconds in three: compute, the communication nothing hides, the bubble."""
    return {
        "compute": cost.compute,
        "exposed communication": cost.exposed_communication,
        "bubble": cost.bubble,
    }


def split_text(counts: tuple[int, ...]) -> str:
    """A stage split with runs folded: (1, 2, 2, 2, 1) -> "1, 2 x 3, 1"."""
    runs: list[list[int]] = []
    for count in counts:
        if runs and runs[-1][0] == count:
            runs[-1][1] += 1
        else:
            runs.append([count, 1])
    return ", ".join(f"{c} x {n}" if n > 1 else str(c) for c, n in runs)


def report(cfg: RecipeConfig) -> str:
    """What `action=suggest` prints: the table, or JSON with `plan.format=json`."""
    import json

    result = search(cfg)
    if cfg.plan.format == "json":
        return json.dumps(search_to_dict(cfg, result))
    return render_search(cfg, result)
