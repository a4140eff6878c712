"""`pretrain-report`: metrics.jsonl with a resume and null MFU drawn into a real PNG with the
dashboard's panels, read back from the data the PNG carries."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

from pretrain.launcher.dashboard import SECTIONS
from pretrain.launcher.report import figure, load_metrics, read_png_data, run_dirs, smooth

REPO = Path(__file__).resolve().parents[2]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def write_run(run_dir: Path) -> None:
    """A run logged to step 30, killed, resumed from its step-20 checkpoint and run to 40;
    MFU was not measured for the first 5 steps."""

    def record(step: int, attempt: int) -> dict:
        return {
            "step": step,
            "time": 1.7e9 + step,
            "loss": 8.0 * math.exp(-step / 15) + 2.0 + 0.01 * attempt,
            "lr": 3e-4 * min(1.0, step / 10),
            "grad_norm": 1.0,
            "tokens_per_s": 40_000.0 + 100 * step,
            "mfu": None if step <= 5 else 0.35 + 0.001 * step,
        }

    run_dir.mkdir()
    lines = [record(s, 0) for s in range(1, 31)] + [record(s, 1) for s in range(21, 41)]
    text = "\n".join(json.dumps(r) for r in lines) + "\n" + '{"step": 41, "lo'
    (run_dir / "metrics.jsonl").write_text(text)


def test_the_last_record_of_each_step_wins_and_the_resume_is_found(tmp_path):
    write_run(tmp_path / "run")
    metrics = load_metrics(tmp_path / "run" / "metrics.jsonl")
    steps, losses = metrics.series("loss")
    assert steps == list(range(1, 41))
    assert losses[24] == 8.0 * math.exp(-25 / 15) + 2.0 + 0.01  # the resumed run's step 25
    assert losses[9] == 8.0 * math.exp(-10 / 15) + 2.0  # before the resume point
    assert metrics.resumed_at == [21]
    assert metrics.skipped_lines == 1  # the cut-off last line
    _, mfu = metrics.series("mfu", 100.0)
    assert all(math.isnan(v) for v in mfu[:5]) and mfu[5] == 100 * (0.35 + 0.006)


def test_pretrain_report_writes_a_png_into_the_run_dir_and_prints_its_path(tmp_path):
    run_dir = tmp_path / "run"
    write_run(run_dir)
    (run_dir / "plan.json").write_text(json.dumps({"mfu": 0.4, "tokens_per_s": 41_000.0}))
    result = subprocess.run(
        [sys.executable, "-m", "pretrain.launcher.report", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    assert result.returncode == 0, result.stderr
    png = run_dir / "report.png"
    assert result.stdout.strip() == str(png)
    data = png.read_bytes()
    assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR"
    assert len(data) > 20_000  # drawn panels, not a blank canvas
    # The panels are the dashboard's line panels the run logged, the loss first.
    panels = {p["title"]: p for p in read_png_data(png)["panels"]}
    logged = {"train loss", "grad norm", "learning rate", "MFU (%)", "tokens/s"}
    assert set(panels) == logged
    dashboard = {p.title for section in SECTIONS.values() for p in section}
    assert {t.removesuffix(" (%)") for t in panels} <= dashboard
    assert next(iter(panels)) == "train loss"
    # Raw and smoothed loss, the resume marked, the plan's predictions on their panels.
    [loss] = panels["train loss"]["series"]
    assert loss["steps"] == list(range(1, 41)) and loss["smoothed"][0] == loss["values"][0]
    assert loss["smoothed"] == smooth(loss["values"]) != loss["values"]
    assert panels["train loss"]["resumed_at"] == [21]
    assert panels["MFU (%)"]["plan"] == 40.0 and panels["tokens/s"]["plan"] == 41_000.0
    assert panels["grad norm"]["plan"] is None
    [mfu] = panels["MFU (%)"]["series"]
    assert mfu["values"][:5] == [None] * 5 and mfu["values"][5] == 100 * (0.35 + 0.006)


def test_smoothing_is_a_debiased_moving_average_that_keeps_gaps() -> None:
    assert smooth([2.0, 2.0, 2.0]) == [2.0, 2.0, 2.0]
    first, gap, third = smooth([1.0, math.nan, 3.0], weight=0.5)
    assert first == 1.0 and math.isnan(gap)
    assert third == (0.5 * 0.5 * 1.0 + 0.5 * 3.0) / (0.5 * 0.5 + 0.5)


def test_a_dir_without_metrics_is_refused_with_a_message(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "pretrain.launcher.report", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    assert result.returncode == 2
    assert "no " in result.stderr and "metrics.jsonl" in result.stderr
    assert not (tmp_path / "report.png").exists()


def test_several_runs_or_a_sweep_dir_are_overlaid_one_line_per_run(tmp_path):
    (tmp_path / "sweep").mkdir()
    for name in ("lr=1e-3", "lr=3e-3"):
        write_run(tmp_path / "sweep" / name)
    dirs = run_dirs([tmp_path / "sweep"])
    assert [d.name for d in dirs] == ["lr=1e-3", "lr=3e-3"]
    fig = figure([(d.name, load_metrics(d / "metrics.jsonl")) for d in dirs], "sweep")
    axes = {ax.get_title(loc="left"): ax for ax in fig.axes if ax.get_visible()}
    assert "validation loss" not in axes  # no run logged it
    labels = [line.get_label() for line in axes["train loss"].get_lines()]
    assert [label for label in labels if not label.startswith("_")] == ["lr=1e-3", "lr=3e-3"]
    result = subprocess.run(
        [sys.executable, "-m", "pretrain.launcher.report", str(tmp_path / "sweep")],
        capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONPATH=str(REPO)),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str((tmp_path / "sweep" / "report.png").resolve())
