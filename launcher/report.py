"""`pretrain-report RUN_DIR [RUN_DIR ...]`: the W&B dashboard's panels drawn offline from
metrics.jsonl, for one run or several overlaid, in one PNG.

Reads RUN_DIR/metrics.jsonl (one JSON object per logged step, as the trainer writes it) and
draws RUN_DIR/report.png with the line panels of `pretrain-dashboard` (launcher/dashboard.py
SECTIONS: throughput, loss, validation loss, grad norm, learning rate, memory, MoE), each
panel only where the run logged its metric. Noisy curves (loss, grad norm) are drawn raw and
smoothed; the plan's predictions (RUN_DIR/plan.json: MFU, tokens/s, memory) are dashed lines
on the panels of what they predict. A resumed or restarted run appends steps it had already
logged before its checkpoint: the last record of each step wins, and the steps where it
went back are marked. A metric logged as null (MFU on a device without a known peak) leaves
a gap. Several run dirs, or a sweep dir (whose points are its run dirs), are overlaid, one
colour per run, into report.png of their common parent.

The PNG carries the data of every panel it draws (the `pretrain-report` text chunk: JSON
of titles, series, smoothed series and plan lines), so what a picture shows can be read
back without re-deriving it. No torch here; matplotlib is imported only when drawing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pretrain.core.inputs.reading import (
    ReadError,
    integer,
    json_objects,
    number,
    read_bytes,
    read_json,
)
from pretrain.core.run.metric_names import flat_name
from pretrain.core.run.rundir import METRICS_FILE, PLAN_FILE
from pretrain.launcher.dashboard import SECTIONS
from pretrain.launcher.output import get_logger, levels_of_one_command, set_verbosity

LOG = get_logger(__name__)

PNG_DATA_KEY = "pretrain-report"
"""The PNG text chunk that holds the drawn panels' data."""
PERCENT = {"mfu", "hfu"}
"""Metrics drawn in percent (logged as fractions)."""
SMOOTHED = {"loss", "grad_norm"}
"""Metrics drawn raw (faint) and smoothed (as W&B's default smoothing does)."""
SMOOTHING = 0.8
"""Weight of the exponential moving average, debiased at the start (TensorBoard's rule)."""
PLAN_KEYS = {"mfu": "mfu", "tokens_per_s": "tokens_per_s", "mem_peak_gib": "memory_gib"}
"""Measured metric -> the plan.json figure that predicts it."""


@dataclass
class Metrics:
    """The records of a run, one per step in step order, and where the run resumed."""

    records: list[dict]
    resumed_at: list[int]
    """First steps logged by resumed runs (each at or below the step logged before it)."""
    skipped_lines: int
    """Lines that were not JSON objects with a step (e.g. a write cut off by a crash)."""

    def series(self, name: str, scale: float = 1.0) -> tuple[list[int], list[float]]:
        """Steps and values of one metric; a missing or null value is NaN (a gap)."""
        values = []
        for record in self.records:
            value = number(record.get(name))
            values.append(math.nan if value is None else value * scale)
        return [r["step"] for r in self.records], values


def load_metrics(path: Path) -> Metrics:
    """Read a metrics.jsonl: the last record per step, sorted by step."""
    by_step: dict[int, dict] = {}
    resumed_at: list[int] = []
    previous = None
    rows, skipped = json_objects(path, "a run's metrics.jsonl (one JSON object per line)")
    for record in rows:
        try:
            step = integer(record.get("step"), path, "step")
        except ReadError:
            step = None
        if step is None:
            skipped += 1
            continue
        # A metric that is not a finite number (text, an infinity) is a gap, as null is.
        record = {**record, "step": step}
        # Steps go up within one run: a step at or below the previous one starts a resume.
        if previous is not None and step <= previous:
            resumed_at.append(step)
        previous = step
        by_step[step] = record
    records = [by_step[s] for s in sorted(by_step)]
    return Metrics(records, sorted(set(resumed_at)), skipped)


@dataclass
class Series:
    """One line of a panel: a run's metric, raw and (for noisy metrics) smoothed."""

    run: str
    metric: str
    steps: list[int]
    values: list[float | None]
    smoothed: list[float | None] | None = None


@dataclass
class ReportPanel:
    """One drawn panel: its title, its lines, the plan's prediction and the resume steps."""

    title: str
    series: list[Series]
    plan: float | None = None
    resumed_at: list[int] = field(default_factory=list)


def smooth(values: list[float], weight: float = SMOOTHING) -> list[float]:
    """Debiased exponential moving average; gaps (NaN) stay gaps and do not reset it."""
    out, average, norm = [], 0.0, 0.0
    for value in values:
        if math.isnan(value):
            out.append(math.nan)
            continue
        average = weight * average + (1 - weight) * value
        norm = weight * norm + (1 - weight)
        out.append(average / norm)
    return out


def _plain(values: list[float]) -> list[float | None]:
    return [None if math.isnan(v) else v for v in values]


def report_panels(runs: list[tuple[str, Metrics]], plan: dict[str, Any]) -> list[ReportPanel]:
    """The dashboard's line panels that some run logged, with their data; `plan` (a single
    run's plan.json, {} for none) adds the predicted figure to the panel of its metric."""
    panels = []
    # The dashboard's sections, the loss first: what a report is opened for.
    order = sorted(SECTIONS, key=lambda name: name != "Loss")
    for section in (SECTIONS[name] for name in order):
        for spec in section:
            if spec.summary:
                continue  # predicted-vs-measured scatter: here, a plan line on the panel
            names = [flat_name(key) for key in spec.y]
            series = []
            for run_name, metrics in runs:
                for name in names:
                    steps, values = metrics.series(name, 100.0 if name in PERCENT else 1.0)
                    if all(math.isnan(v) for v in values):
                        continue
                    smoothed = _plain(smooth(values)) if name in SMOOTHED else None
                    series.append(Series(run_name, name, steps, _plain(values), smoothed))
            if not series:
                continue
            title = spec.title + (" (%)" if set(names) & PERCENT else "")
            predicted = [plan.get(PLAN_KEYS[n]) for n in names if n in PLAN_KEYS]
            number = next((v for v in predicted if isinstance(v, (int, float))), None)
            if number is not None and set(names) & PERCENT:
                number *= 100.0
            resumed = runs[0][1].resumed_at if len(runs) == 1 else []
            panels.append(ReportPanel(title, series, number, list(resumed)))
    return panels


def draw(runs: list[tuple[str, Metrics]], out: Path, title: str, plan: dict | None = None) -> Path:
    """Draw the panels of one run, or of several overlaid, into `out` (PNG), with their data
    in the PNG's PNG_DATA_KEY text chunk."""
    panels = report_panels(runs, plan or {})
    data = json.dumps({"title": title, "panels": [asdict(p) for p in panels]})
    figure(runs, title, panels).savefig(out, format="png", metadata={PNG_DATA_KEY: data})
    return out


def read_png_data(path: Path) -> dict[str, Any]:
    """The panel data a report PNG carries (see `draw`)."""
    data = read_bytes(path, "a PNG drawn by pretrain report", 64 << 20)
    return json.loads(png_text_chunks(data)[PNG_DATA_KEY])


def png_text_chunks(data: bytes) -> dict[str, str]:
    """The tEXt chunks of a PNG (keyword -> text), as matplotlib writes `metadata`."""
    import struct
    import zlib

    chunks: dict[str, str] = {}
    at = 8  # after the signature
    while at + 8 <= len(data):
        length, kind = struct.unpack(">I4s", data[at : at + 8])
        body = data[at + 8 : at + 8 + length]
        if kind == b"tEXt":
            keyword, _, text = body.partition(b"\0")
            chunks[keyword.decode("latin-1")] = text.decode("latin-1")
        elif kind == b"zTXt":
            keyword, _, rest = body.partition(b"\0")
            chunks[keyword.decode("latin-1")] = zlib.decompress(rest[1:]).decode("latin-1")
        elif kind == b"iTXt":
            keyword, _, rest = body.partition(b"\0")
            flag, _method, rest = rest[0], rest[1], rest[2:]
            _language, _, rest = rest.partition(b"\0")
            _translated, _, text = rest.partition(b"\0")
            chunks[keyword.decode("latin-1")] = (zlib.decompress(text) if flag else text).decode()
        at += 12 + length
    return chunks


def figure(
    runs: list[tuple[str, Metrics]], title: str, panels: list[ReportPanel] | None = None
) -> Any:
    """The matplotlib Figure of `draw`: one axes per panel, one line per run and metric."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    panels = report_panels(runs, {}) if panels is None else panels
    columns = 3
    rows = max(1, math.ceil(len(panels) / columns))
    fig = Figure(figsize=(14, 3.2 * rows + 0.6), dpi=100, layout="constrained")
    grid = fig.subplots(rows, columns, sharex=True, squeeze=False).flat
    axes = list(grid)
    for ax in axes[len(panels) :]:
        ax.set_visible(False)
    for ax, panel in zip(axes, panels, strict=False):
        _draw_panel(ax, panel, overlay=len(runs) > 1)
    for ax in axes[max(0, len(panels) - columns) : len(panels)]:
        ax.set_xlabel("step")
    fig.suptitle(title)
    return fig


def _draw_panel(ax: Any, panel: ReportPanel, overlay: bool) -> None:
    """One panel's lines, its plan line and its resume marks."""
    runs = list(dict.fromkeys(s.run for s in panel.series))
    for i, series in enumerate(panel.series):
        colour = f"C{(runs.index(series.run) if overlay else i) % 10}"
        label = series.run if overlay else series.metric
        steps, values = series.steps, [math.nan if v is None else v for v in series.values]
        if series.metric == "val_loss":
            steps, values = _measured(steps, values)
        sparse = len(steps) < 40
        if series.smoothed is not None:
            ax.plot(steps, values, color=colour, alpha=0.3, linewidth=1)
            smoothed = [math.nan if v is None else v for v in series.smoothed]
            ax.plot(series.steps, smoothed, color=colour, linewidth=1.6, label=label)
        else:
            ax.plot(steps, values, color=colour, linewidth=1.4, label=label,
                    marker="." if sparse else None)  # fmt: skip
    if panel.plan is not None:
        ax.axhline(panel.plan, color="gray", linestyle=":", linewidth=1.2, label="plan")
    for i, step in enumerate(panel.resumed_at):
        ax.axvline(step, color="tab:orange", linestyle="--", linewidth=1,
                   label="resumed" if i == 0 else None)  # fmt: skip
    if overlay or len(panel.series) > 1 or panel.plan is not None or panel.resumed_at:
        ax.legend(loc="best", fontsize="x-small")
    ax.set_title(panel.title, loc="left", fontsize="medium")
    ax.grid(True, alpha=0.3)
    if panel.series[0].metric == "lr":
        ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))


def _measured(steps: list[int], values: list[float]) -> tuple[list[int], list[float]]:
    """The measured points only: validation runs every k steps, and its line joins them."""
    kept = [(s, v) for s, v in zip(steps, values, strict=True) if not math.isnan(v)]
    return [s for s, _ in kept], [v for _, v in kept]


def _title(run_dir: Path, metrics: Metrics) -> str:
    last = metrics.records[-1]
    parts = [run_dir.name, f"step {last['step']}"]
    loss = number(last.get("loss"))
    if loss is not None:
        parts.append(f"loss {loss:.4f}")
    return " | ".join(parts)


def _plan(run_dir: Path) -> dict[str, Any]:
    """The run's plan.json as the launcher wrote it; {} when absent or unreadable (the
    report then draws no plan lines)."""
    try:
        plan = read_json(run_dir / PLAN_FILE, "the launcher's plan of the run (JSON)", 64 << 20)
    except ReadError:
        return {}
    return plan if isinstance(plan, dict) else {}


def run_dirs(paths: list[Path]) -> list[Path]:
    """The run dirs of the arguments: each run dir itself, a sweep dir's points in order."""
    found = []
    for path in paths:
        if (path / METRICS_FILE).is_file() or not path.is_dir():
            found.append(path)
        else:
            found += sorted(p for p in path.iterdir() if (p / METRICS_FILE).is_file()) or [path]
    return found


def _load(run_dir: Path) -> Metrics:
    source = run_dir / METRICS_FILE
    if not source.exists():
        LOG.error(f"pretrain-report: no {source}; give a run dir the trainer logged to")
        raise SystemExit(2)
    metrics = load_metrics(source)
    if not metrics.records:
        LOG.error(f"pretrain-report: {source} holds no logged step yet")
        raise SystemExit(2)
    if metrics.skipped_lines:
        LOG.warning(f"pretrain-report: {source}: skipped {metrics.skipped_lines} unreadable "
                    "line(s)")  # fmt: skip
    return metrics


def main(argv: list[str] | None = None) -> None:
    """Console entry point of `pretrain-report`, inside the error boundary."""
    from pretrain.core.inputs.boundary import run_command

    with levels_of_one_command():
        run_command("pretrain-report", lambda: _main(argv))


def _main(argv: list[str] | None) -> None:
    """Draw the PNG and print its path."""
    parser = argparse.ArgumentParser(
        prog="pretrain-report",
        description="Draw the curves of RUN_DIR/metrics.jsonl into RUN_DIR/report.png; "
        "several run dirs (or a sweep dir) are overlaid into report.png of their parent.",
    )
    parser.add_argument("run_dir", type=Path, nargs="+", help="run dirs, or a sweep dir")
    parser.add_argument("--out", type=Path, help="PNG path (default: see above)")
    args = parser.parse_args(set_verbosity(sys.argv[1:] if argv is None else argv))
    dirs = run_dirs(args.run_dir)
    runs = [(d.name, _load(d)) for d in dirs]
    plan: dict[str, Any] = {}
    if len(runs) == 1:
        title = _title(dirs[0], runs[0][1])
        default = dirs[0] / "report.png"
        plan = _plan(dirs[0])
    else:
        parent = Path(os.path.commonpath([d.resolve() for d in dirs]))
        title = f"{len(runs)} runs under {parent.name or parent}"
        default = parent / "report.png"
    out = args.out or default
    if out.exists() and not out.is_file():
        found = "a directory" if out.is_dir() else "not a regular file"
        raise ReadError(out, found, "the PNG file to write", "give --out a new file's path")
    print(draw(runs, out, title, plan))


if __name__ == "__main__":
    main()
