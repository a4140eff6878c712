"""`pretrain-report RUN_DIR [RUN_DIR ...]`: the curves of one run, or of several overlaid,
in one PNG.

Reads RUN_DIR/metrics.jsonl (one JSON object per logged step, as the trainer writes it) and
draws RUN_DIR/report.png (loss, LR, tokens/s, MFU), for users who do not use W&B. Several
run dirs, or a sweep dir (whose points are its run dirs), are overlaid, one colour per run
(loss, validation loss, tokens/s, MFU), into report.png of their common parent. A resumed
run appends steps it had already logged before its last checkpoint: the last record of
each step wins, and the steps where a run resumed are marked. A metric logged as null (MFU
on a device without a known peak) leaves a gap. No torch here; matplotlib is imported only
when drawing.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pretrain_core.inputs.reading import ReadError, integer, json_objects, number
from pretrain_core.run.rundir import METRICS_FILE

PANELS = (
    ("loss", "loss", 1.0),
    ("lr", "learning rate", 1.0),
    ("tokens_per_s", "tokens/s", 1.0),
    ("mfu", "MFU (%)", 100.0),
)
"""(metric, axis label, scale) of each panel, left to right and top to bottom."""
OVERLAY_PANELS = (
    ("loss", "loss", 1.0),
    ("val_loss", "validation loss", 1.0),
    ("tokens_per_s", "tokens/s", 1.0),
    ("mfu", "MFU (%)", 100.0),
)
"""The panels when several runs are overlaid."""


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


def draw(runs: list[tuple[str, Metrics]], out: Path, title: str) -> Path:
    """Draw the four panels of one run, or of several overlaid, into `out` (PNG)."""
    figure(runs, title).savefig(out, format="png")
    return out


def figure(runs: list[tuple[str, Metrics]], title: str) -> Any:
    """The matplotlib Figure of `draw`: one panel per metric, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 7), dpi=110, layout="constrained")
    axes = fig.subplots(2, 2, sharex=True).flat
    panels = PANELS if len(runs) == 1 else OVERLAY_PANELS
    for ax, (name, label, scale) in zip(axes, panels, strict=True):
        drawn = 0
        for i, (run_name, metrics) in enumerate(runs):
            steps, values = metrics.series(name, scale)
            if all(math.isnan(v) for v in values):
                continue
            drawn += 1
            ax.plot(
                *(_measured(steps, values) if name == "val_loss" else (steps, values)),
                color="tab:blue" if len(runs) == 1 else f"C{i % 10}",
                linewidth=1.4,
                marker="." if len(steps) < 40 else None,
                label=run_name if len(runs) > 1 else None,
            )
        if not drawn:
            ax.text(0.5, 0.5, f"{name} not measured", ha="center", va="center",
                    transform=ax.transAxes, color="gray")  # fmt: skip
        if len(runs) == 1:
            _mark_resumes(ax, runs[0][1])
        elif drawn:
            ax.legend(loc="best", fontsize="x-small")
        ax.set_title(label, loc="left", fontsize="medium")
        ax.grid(True, alpha=0.3)
        if name == "lr":
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    for ax in list(fig.axes)[2:]:
        ax.set_xlabel("step")
    fig.suptitle(title)
    return fig


def _measured(steps: list[int], values: list[float]) -> tuple[list[int], list[float]]:
    """The measured points only: validation runs every k steps, and its line joins them."""
    kept = [(s, v) for s, v in zip(steps, values, strict=True) if not math.isnan(v)]
    return [s for s, _ in kept], [v for _, v in kept]


def _mark_resumes(ax: Any, metrics: Metrics) -> None:
    for i, step in enumerate(metrics.resumed_at):
        ax.axvline(step, color="tab:orange", linestyle="--", linewidth=1,
                   label="resumed" if i == 0 else None)  # fmt: skip
    if metrics.resumed_at:
        ax.legend(loc="best", fontsize="small")


def _title(run_dir: Path, metrics: Metrics) -> str:
    last = metrics.records[-1]
    parts = [run_dir.name, f"step {last['step']}"]
    loss = number(last.get("loss"))
    if loss is not None:
        parts.append(f"loss {loss:.4f}")
    return " | ".join(parts)


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
        print(f"pretrain-report: no {source}; give a run dir the trainer logged to",
              file=sys.stderr)  # fmt: skip
        raise SystemExit(2)
    metrics = load_metrics(source)
    if not metrics.records:
        print(f"pretrain-report: {source} holds no logged step yet", file=sys.stderr)
        raise SystemExit(2)
    if metrics.skipped_lines:
        print(f"pretrain-report: {source}: skipped {metrics.skipped_lines} unreadable line(s)",
              file=sys.stderr)  # fmt: skip
    return metrics


def main(argv: list[str] | None = None) -> None:
    """Console entry point of `pretrain-report`, inside the error boundary."""
    from pretrain_core.inputs.boundary import run_command

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
    args = parser.parse_args(argv)
    dirs = run_dirs(args.run_dir)
    runs = [(d.name, _load(d)) for d in dirs]
    if len(runs) == 1:
        title = _title(dirs[0], runs[0][1])
        default = dirs[0] / "report.png"
    else:
        parent = Path(os.path.commonpath([d.resolve() for d in dirs]))
        title = f"{len(runs)} runs under {parent.name or parent}"
        default = parent / "report.png"
    out = args.out or default
    if out.exists() and not out.is_file():
        found = "a directory" if out.is_dir() else "not a regular file"
        raise ReadError(out, found, "the PNG file to write", "give --out a new file's path")
    print(draw(runs, out, title))


if __name__ == "__main__":
    main()
