"""`pretrain-report RUN_DIR`: the loss, LR, tokens/s and MFU curves of a run in one PNG.

Reads RUN_DIR/metrics.jsonl (one JSON object per logged step, as the trainer writes it) and
draws RUN_DIR/report.png, for users who do not use W&B. A resumed run appends steps it had
already logged before its last checkpoint: the last record of each step wins, and the
steps where a run resumed are marked. A metric logged as null (MFU on a device without a
known peak) leaves a gap. No torch here; matplotlib is imported only when drawing.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

from pretrain_core.rundir import METRICS_FILE

PANELS = (
    ("loss", "loss", 1.0),
    ("lr", "learning rate", 1.0),
    ("tokens_per_s", "tokens/s", 1.0),
    ("mfu", "MFU (%)", 100.0),
)
"""(metric, axis label, scale) of each panel, left to right and top to bottom."""


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
            value = record.get(name)
            values.append(math.nan if value is None else float(value) * scale)
        return [r["step"] for r in self.records], values


def load_metrics(path: Path) -> Metrics:
    """Read a metrics.jsonl: the last record per step, sorted by step."""
    by_step: dict[int, dict] = {}
    resumed_at: list[int] = []
    skipped = 0
    previous = None
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            step = int(record["step"])
        except (ValueError, TypeError, KeyError):
            skipped += 1
            continue
        # Steps go up within one run: a step at or below the previous one starts a resume.
        if previous is not None and step <= previous:
            resumed_at.append(step)
        previous = step
        by_step[step] = record
    records = [by_step[s] for s in sorted(by_step)]
    return Metrics(records, sorted(set(resumed_at)), skipped)


def draw(metrics: Metrics, out: Path, title: str) -> Path:
    """Draw the four panels into `out` (PNG) and return it."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 7), dpi=110, layout="constrained")
    axes = fig.subplots(2, 2, sharex=True).flat
    for ax, (name, label, scale) in zip(axes, PANELS, strict=True):
        steps, values = metrics.series(name, scale)
        known = [v for v in values if not math.isnan(v)]
        if known:
            ax.plot(
                steps,
                values,
                color="tab:blue",
                linewidth=1.4,
                marker="." if len(steps) < 40 else None,
            )
        else:
            ax.text(
                0.5,
                0.5,
                f"{name} not measured in this run",
                ha="center",
                va="center",
                transform=ax.transAxes,
                color="gray",
            )
        for i, step in enumerate(metrics.resumed_at):
            ax.axvline(
                step,
                color="tab:orange",
                linestyle="--",
                linewidth=1,
                label="resumed" if i == 0 else None,
            )
        if metrics.resumed_at:
            ax.legend(loc="best", fontsize="small")
        ax.set_title(label, loc="left", fontsize="medium")
        ax.grid(True, alpha=0.3)
        if name == "lr":
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    for ax in list(fig.axes)[2:]:
        ax.set_xlabel("step")
    fig.suptitle(title)
    fig.savefig(out, format="png")
    return out


def _title(run_dir: Path, metrics: Metrics) -> str:
    last = metrics.records[-1]
    parts = [run_dir.name, f"step {last['step']}"]
    if last.get("loss") is not None:
        parts.append(f"loss {last['loss']:.4f}")
    return " | ".join(parts)


def main(argv: list[str] | None = None) -> None:
    """Console entry point of `pretrain-report`: draw RUN_DIR/report.png and print its path."""
    parser = argparse.ArgumentParser(
        prog="pretrain-report",
        description="Draw the loss, LR, tokens/s and MFU curves of RUN_DIR/metrics.jsonl "
        "into RUN_DIR/report.png.",
    )
    parser.add_argument("run_dir", type=Path, help="a run dir holding metrics.jsonl")
    parser.add_argument("--out", type=Path, help="PNG path (default: RUN_DIR/report.png)")
    args = parser.parse_args(argv)
    source = args.run_dir / METRICS_FILE
    if not source.is_file():
        print(
            f"pretrain-report: no {source}; give a run dir the trainer logged to", file=sys.stderr
        )
        raise SystemExit(2)
    metrics = load_metrics(source)
    if not metrics.records:
        print(f"pretrain-report: {source} holds no logged step yet", file=sys.stderr)
        raise SystemExit(2)
    if metrics.skipped_lines:
        print(
            f"pretrain-report: skipped {metrics.skipped_lines} unreadable line(s)", file=sys.stderr
        )
    out = draw(metrics, args.out or args.run_dir / "report.png", _title(args.run_dir, metrics))
    print(out)


if __name__ == "__main__":
    main()
