"""The plan as a readable text report (rich tables rendered to a string)."""

from __future__ import annotations

import io
from typing import TYPE_CHECKING, Any

from pretrain.core.hardware import GIB
from pretrain.core.schedules import SCHEDULES
from pretrain.launcher.plan.muon_work import MuonWork
from pretrain.launcher.plan.plan import Plan

if TYPE_CHECKING:
    from rich.console import Console, JustifyMethod
    from rich.table import Table

    from pretrain.launcher.plan.memory import MemoryBreakdown

WIDTH = 100
MEMBERS_SHOWN = 8
"""Ranks listed per group before the list is abbreviated."""


def render_plan(plan: Plan, with_warnings: bool = True) -> str:
    """A multi-section plain-text table of the plan, WIDTH columns wide; its warnings last
    unless `with_warnings` is false (a run logs them as warnings of their own)."""
    # rich costs ~20 ms to import: only `action=plan` with the table format pays it.
    from rich.console import Console

    console = Console(record=True, width=WIDTH, file=io.StringIO(), color_system=None)
    _section(console, f"Plan: {plan.name}", _layout_rows(plan))
    _section(console, "Model", _model_rows(plan))
    _section(console, "Compute", _compute_rows(plan))
    if plan.pipeline is not None:
        _pipeline_section(console, plan.pipeline)
    if plan.tp_comm is not None:
        tp = plan.tp_comm
        kinds = " + ".join(f"{n} {kind.replace('_', '-')}" for kind, n in tp.collectives.items())
        _section(
            console,
            "TP communication per layer per step (one rank)",
            [
                ("collectives per micro-batch", kinds),
                ("activations they carry", _bytes(tp.message_bytes)),
                ("bytes sent (ring)", _bytes(tp.sent_bytes)),
            ],
        )
    if plan.cp_comm is not None:
        cp = plan.cp_comm
        where = "crosses nodes" if cp.crosses_nodes else "inside a node"
        _section(
            console,
            "CP ring per layer per step (one rank)",
            [
                ("hops per micro-batch", ", ".join(f"{n} {k}" for k, n in cp.hops.items())),
                ("bytes sent", _bytes(cp.sent_bytes)),
                ("ring", f"cp ranks tp apart, spanning {cp.ring_span} ranks: {where}"),
            ],
        )
    if plan.ep_comm is not None:
        ep = plan.ep_comm
        _section(
            console,
            "EP all-to-all per MoE layer per micro-batch (one rank)",
            [
                ("bytes sent", _bytes(ep.message_bytes)),
                ("nodes a token's rows reach", f"at most {ep.nodes_per_token}"),
                ("leaving the node, a row per token and node", _bytes(ep.inter_node_bytes)),
            ],
        )
    if plan.phases:
        console.print(_phases_table(plan))
    if plan.mixture_phases:
        console.print(_mixture_table(plan))
    if plan.muon is not None:
        _section(console, "Muon Newton-Schulz per step (busiest rank)", _muon_rows(plan.muon))
    if plan.etp_comm is not None:
        etp = plan.etp_comm
        _section(
            console,
            "ETP all-reduces per MoE layer per micro-batch (one rank)",
            [
                ("routed output (forward) and its input's gradient", _bytes(etp.output_bytes)),
                ("routing weights' gradient (backward)", _bytes(etp.gate_bytes)),
            ],
        )
    if plan.memory is not None:
        console.print(_breakdown_table(plan, plan.memory))
    console.print(_zero_paper_table(plan))
    _section(console, "Fit and speed", _fit_rows(plan))
    for line in plan.warnings if with_warnings else []:
        console.print(f"warning: {line}")
    for line in plan.assumptions:
        console.print(f"assumed: {line}")
    return console.export_text()


def _muon_rows(work: MuonWork) -> list[tuple[str, str]]:
    split = f"over {work.ranks} ranks" if work.ranks > 1 else "not split"
    extra = "more" if work.extra_bytes >= 0 else "fewer"
    return [
        ("work split", split),
        ("FLOPs", f"{_flops(work.flops)} ({_flops(work.saved_flops)} fewer than unsplit)"),
        (
            "bytes received",
            f"{_bytes(work.bytes)} ({_bytes(abs(work.extra_bytes))} {extra} than unsplit)",
        ),
    ]


def _section(console: Console, title: str, rows: list[tuple[str, str]]) -> None:
    from rich.table import Table

    table = Table(title=title, title_justify="left", show_header=False, min_width=60)
    table.add_column(style="bold")
    table.add_column(overflow="fold")
    for key, value in rows:
        table.add_row(key, value)
    console.print(table)


def _layout_rows(plan: Plan) -> list[tuple[str, str]]:
    d = plan.degrees
    degrees = (
        f"pp={d.pp} dp_replicate={d.dp_replicate} dp_shard={d.dp_shard} "
        f"cp={d.cp} tp={d.tp} ep={d.ep} (dp={d.dp})"
    )
    rows = [("world", f"{d.world} ranks"), ("degrees", degrees)]
    if d.ep > 1 or d.etp > 1:
        # The experts' own mesh over the same ranks (parallel/mesh.py).
        same = f", {d.tp // d.etp} tp ranks per slice" if d.tp > d.etp else ""
        rows.append(("expert mesh", f"ep={d.ep} x etp={d.etp} x edp={d.dp // d.ep * d.cp}{same}"))
    return rows + [
        (f"{dim} groups", _groups(groups, plan.rank_group_counts[dim]))
        for dim, groups in plan.rank_groups.items()
        if len(groups[0]) > 1  # a dim of size 1 groups nothing
    ]


def _model_rows(plan: Plan) -> list[tuple[str, str]]:
    return [
        ("parameters", _count(plan.params_total)),
        ("active per token", _count(plan.params_active)),
        ("non-embedding", _count(plan.params_non_embedding)),
        (
            "first / last stage",
            f"{_count(plan.params_first_stage)} / {_count(plan.params_last_stage)}",
        ),
        ("per rank (largest stage / tp)", _count(plan.params_per_rank)),
    ]


def _compute_rows(plan: Plan) -> list[tuple[str, str]]:
    return [
        ("FLOPs/token forward", _flops(plan.flops_per_token_forward)),
        ("FLOPs/token train (MFU)", _flops(plan.flops_per_token_train)),
        ("FLOPs/token with recompute (HFU)", _flops(plan.flops_per_token_hardware)),
        ("tokens per step", f"{plan.tokens_per_step:,}"),
        ("grad-accum steps", str(plan.grad_accum)),
        ("pipeline micro-batches", str(plan.pp_microbatches)),
        ("pipeline bubble", f"{plan.bubble_fraction:.1%}"),
    ] + ([("FP8", plan.fp8)] if plan.fp8 else [])


def _zero_paper_table(plan: Plan) -> Table:
    from rich.table import Table

    memory = Table(title="Memory per rank (ZeRO paper)", title_justify="left", min_width=60)
    for column in ("ZeRO", "params", "grads", "optimizer", "model states", "+ activations"):
        memory.add_column(column, justify="right")
    for zero, states in plan.model_states_by_zero.items():
        mark = " *" if zero == plan.zero else ""
        memory.add_row(
            f"{zero}{mark}",
            *(_bytes(v) for v in (states.params, states.grads, states.optimizer)),
            _bytes(states.total),
            _bytes(states.total + plan.activations),
        )
    return memory


def _phases_table(plan: Plan) -> Table:
    """Each phase of the ramp at its own batch and seq_len."""
    from rich.table import Table

    table = Table(
        title="Phases (train.batch_schedule, train.seq_len_schedule; LR by tokens)",
        title_justify="left",
        min_width=60,
    )
    columns = ("steps", "from tokens", "batch x seq_len", "accum", "memory", "step time", "MFU")
    for column in columns:
        table.add_column(column, justify="right")
    for ph in plan.phases:
        table.add_row(
            f"{ph.first_step}-{ph.last_step}",
            f"{ph.tokens_before:,}",
            f"{ph.global_batch} x {ph.seq_len}",
            str(ph.grad_accum),
            f"{ph.memory_gib:.2f} GiB",
            _maybe(ph.step_time_s, "{:.3g} s"),
            _maybe(ph.mfu, "{:.1%}"),
        )
    return table


def _mixture_table(plan: Plan) -> Table:
    """Each phase of the mixture schedule: where it starts and its shares there."""
    from rich.table import Table

    table = Table(title="Mixture phases (data.mixture_schedule)", title_justify="left")
    for column in ("phase", "from step", "from tokens", "shares"):
        table.add_column(column, justify="left")
    for ph in plan.mixture_phases:
        shares = ", ".join(f"{label} {q:.3g}" for label, q in ph.shares.items())
        table.add_row(
            ph.name,
            "not reached" if ph.first_step is None else str(ph.first_step),
            f"{ph.from_tokens:,}",
            shares + (", blending into the next" if ph.blend else ""),
        )
    return table


def _fit_rows(plan: Plan) -> list[tuple[str, str]]:
    gpu = f"{plan.gpu_memory_gib:g} GiB" if plan.gpu_memory_gib else "n/a (cpu)"
    return [
        ("activations", _bytes(plan.activations)),
        (f"total at ZeRO {plan.zero}", _bytes(plan.memory_gib * GIB)),
        (f"device memory ({plan.gpu_type})", gpu),
        ("peak TFLOP/s per device", _maybe(plan.peak_tflops, "{:g}")),
        ("step time (cost model)", _maybe(plan.step_time_s, "{:.3g} s")),
        ("  of which", _terms(plan)),
        ("predicted MFU", _maybe(plan.mfu, "{:.1%}")),
        ("tokens/s", _maybe(plan.tokens_per_s, "{:,.0f}")),
    ]


def _terms(plan: Plan) -> str:
    """The cost model's terms that add up to the step time."""
    if plan.step_cost is None:
        return "n/a"
    return ", ".join(f"{name} {sec:.3g} s" for name, sec in plan.step_cost.terms().items() if sec)


BAR_WIDTH = 24


def _pipeline_section(console: Console, pipeline: dict[str, Any]) -> None:
    """The simulated schedule: its figures, then the chart unwrapped (it may be wider)."""
    m, shown = pipeline["microbatches"], pipeline["charted_microbatches"]
    per_stage = "  ".join(
        f"{idle:.1%}/{held:g}"
        for idle, held in zip(
            pipeline["idle_fraction_per_stage"], pipeline["peak_in_flight_per_stage"], strict=True
        )
    )
    console.print(f"Pipeline schedule: {pipeline['schedule']}, {m} micro-batches")
    segment = pipeline.get("segment_steps", 1)
    flushes = SCHEDULES[pipeline["schedule"]].flushes
    over = "" if flushes else f", over {segment} steps between drains"
    console.print(f"  bubble (simulated{over}): {pipeline['bubble_fraction']:.1%}")
    console.print(f"  per stage, idle / peak micro-batches in flight: {per_stage}")
    console.print(f"  costs: {pipeline['costs']}")
    more = (
        f" for {shown} of the {m} micro-batches (bubble {pipeline['charted_bubble_fraction']:.1%})"
        if shown < m
        else ""
    )
    if pipeline.get("charted_steps", 1) > 1:
        more += f", {pipeline['charted_steps']} steps without a flush"
    console.print(f"  chart{more}; F/B/W + micro-batch (+ chunk), . idle:")
    console.print(pipeline["chart"], soft_wrap=True, highlight=False)


def _breakdown_table(plan: Plan, breakdown: MemoryBreakdown) -> Table:
    """Peak memory per rank by category, each with a bar scaled to the device (or the peak)."""
    from rich.table import Table

    scale = (plan.gpu_memory_gib or 0) * GIB or breakdown.total or 1
    where = f"of {plan.gpu_memory_gib:g} GiB" if plan.gpu_memory_gib else "of the peak"
    table = Table(
        title=f"Memory per rank, this trainer (peak at the {breakdown.peak_phase}; bars {where})",
        title_justify="left",
        min_width=60,
    )
    columns: tuple[tuple[str, JustifyMethod], ...] = (
        ("category", "left"),
        ("size", "right"),
        ("", "left"),
        ("how", "left"),
    )
    for column, justify in columns:
        table.add_column(column, justify=justify, overflow="fold")
    for name, size, how in breakdown.rows():
        table.add_row(name, _bytes(size), _bar(size / scale), how)
    table.add_row("total", _bytes(breakdown.total), _bar(breakdown.total / scale), "")
    if breakdown.host:
        how = "offloaded shards, gradients and optimizer states (parallel.offload)"
        table.add_row("host memory", _bytes(breakdown.host), "", how)
    return table


def _bar(fraction: float) -> str:
    cells = min(BAR_WIDTH, round(max(fraction, 0.0) * BAR_WIDTH))
    return "█" * cells + "·" * (BAR_WIDTH - cells)


def _groups(groups: list[list[int]], count: int) -> str:
    shown = "  ".join(_members(g) for g in groups)
    more = f"  … ({count} groups)" if count > len(groups) else ""
    return shown + more


def _members(ranks: list[int]) -> str:
    if len(ranks) <= MEMBERS_SHOWN:
        return "[" + ",".join(map(str, ranks)) + "]"
    head = ",".join(map(str, ranks[: MEMBERS_SHOWN - 2]))
    return f"[{head},…,{ranks[-1]}] ({len(ranks)} ranks)"


def _count(n: int) -> str:
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.2f}{suffix} ({n:,})"
    return f"{n:,}"


def _flops(n: int) -> str:
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.3g} {prefix}FLOP"
    return f"{n} FLOP"


def _bytes(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 2**20:.1f} MiB"


def _maybe(value: float | None, fmt: str) -> str:
    return fmt.format(value) if value is not None else "n/a"


def render_summary(plan: Plan) -> str:
    """The plan in a few lines, as a run prints it before its job (plan.before_run=summary):
    layout, size, memory and speed; action=plan prints the whole. The plan's warnings are
    not in it: a run logs them as warnings, which -q does not hide."""
    d = plan.degrees
    split = " ".join(
        f"{name}={size}"
        for name, size in (("pp", d.pp), ("dp_replicate", d.dp_replicate),
                           ("dp_shard", d.dp_shard), ("cp", d.cp), ("tp", d.tp), ("ep", d.ep),
                           ("etp", d.etp))
        if size > 1
    )  # fmt: skip
    gpu = f"of {plan.gpu_memory_gib:g} GiB" if plan.gpu_memory_gib else "(no device limit)"
    # The trainer's own breakdown where there is one: what the fit check refuses on.
    peak_gib = plan.memory.total_gib if plan.memory is not None else plan.memory_gib
    lines = [
        f"plan: {plan.name} on {d.world} rank{'s' if d.world > 1 else ''}"
        + (f" ({split})" if split else "")
        + f", {_count(plan.params_total)} parameters, {plan.tokens_per_step:,} tokens/step"
        + (f", bubble {plan.bubble_fraction:.1%}" if d.pp > 1 else ""),
        f"  memory per rank {_bytes(peak_gib * GIB)} {gpu} | step time "
        f"{_maybe(plan.step_time_s, '{:.3g} s')} | MFU {_maybe(plan.mfu, '{:.1%}')} | "
        f"tokens/s {_maybe(plan.tokens_per_s, '{:,.0f}')}",
    ]
    if plan.phases:
        stages = ", ".join(
            f"{ph.first_step}-{ph.last_step} {ph.global_batch}x{ph.seq_len}" for ph in plan.phases
        )
        lines.append(f"  ramp (steps batch x seq_len): {stages}; the figures above: the last")
    lines.append("  (the whole plan: action=plan, or plan.before_run=full)")
    return "\n".join(lines)
