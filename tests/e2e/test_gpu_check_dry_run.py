"""The GPU check's CPU dry mode: its own logic runs end to end and invents no GPU figures."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pretrain.core.precision import backend_installed

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench" / "gpu"))
import check

pytestmark = [pytest.mark.e2e, pytest.mark.slow]  # trains bf16 and emulated fp8

ROOT = Path(__file__).resolve().parents[2]


def test_dry_run_trains_bf16_and_emulated_fp8_and_reports_only_what_it_measured(tmp_path):
    out = tmp_path / "rows.json"
    command = [sys.executable, str(ROOT / "bench" / "gpu" / "check.py"), "--dry-run"]
    command += ["--steps", "1", "--warmup", "1", "--seq-len", "32", "--micro-batch", "1"]
    command += ["--recompute", "none", "--compile", "off", "--json", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "torch: " in result.stdout and "cuda: not available" in result.stdout
    assert "dry run on CPU: no GPU figures" in result.stdout

    report = json.loads(out.read_text())
    assert report["environment"]["cuda"] == "not available" and report["elapsed_s"] > 0
    rows = {row["precision"]: row for row in report["rows"]}
    assert list(rows) == ["bf16", "fp8-torchao", "fp8-te"]
    for name in ("bf16", "fp8-torchao"):
        row = rows[name]
        assert row["status"] == "ok" and row["recompute"] == "none"
        assert row["tokens_per_s"] > 0 and row["tflops"] > 0 and row["plan_mem_gib"] > 0
        # No GPU: no MFU, no peak, no device memory (so no plan error).
        assert (row["mfu"], row["peak_source"], row["mem_gib"]) == (None, "", None)
        assert row["plan_error"] is None and row["compile"] == "off"
        # The kernels the step ran, as the trainer's start-up line names them.
        assert row["sdpa"] == "flash (CPU)" and row["optimizer"] == "fused"
    te = rows["fp8-te"]
    assert te["tokens_per_s"] is None and te["status"].startswith("skipped")
    if not backend_installed("te"):
        assert "transformer-engine[pytorch]" in te["status"]


def test_the_full_check_runs_every_policy_eager_then_compiled_within_its_budget():
    args = argparse.Namespace(recompute=None, compile=None)
    configs = check.configurations(args)
    assert len(configs) == 3 * 3 + 3
    assert {r for _, r, c in configs if c == "off"} == {"none", "selective", "full"}
    assert [c for _, _, c in configs][-3:] == ["on"] * 3
    assert check.BUDGET_S <= 8 * 60 - 30
