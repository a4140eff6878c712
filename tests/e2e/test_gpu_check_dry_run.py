"""The GPU check's CPU dry mode: its own logic runs end to end and invents no GPU figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pretrain_core.precision import backend_installed

pytestmark = [pytest.mark.e2e, pytest.mark.slow]  # trains bf16 and emulated fp8

ROOT = Path(__file__).resolve().parents[2]


def test_dry_run_trains_bf16_and_emulated_fp8_and_reports_only_what_it_measured(tmp_path):
    out = tmp_path / "rows.json"
    command = [sys.executable, str(ROOT / "bench" / "gpu" / "check.py"), "--dry-run"]
    command += ["--steps", "1", "--warmup", "1", "--seq-len", "32", "--micro-batch", "1"]
    command += ["--recompute", "none", "--json", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "torch: " in result.stdout and "cuda: not available" in result.stdout
    assert "dry run on CPU: no GPU figures" in result.stdout

    rows = {row["precision"]: row for row in json.loads(out.read_text())}
    assert list(rows) == ["bf16", "fp8-torchao", "fp8-te"]
    for name in ("bf16", "fp8-torchao"):
        row = rows[name]
        assert row["status"] == "ok" and row["recompute"] == "none"
        assert row["tokens_per_s"] > 0 and row["tflops"] > 0 and row["plan_mem_gib"] > 0
        # No GPU: no MFU, no peak, no device memory.
        assert (row["mfu"], row["peak_source"], row["mem_gib"]) == (None, "", None)
    te = rows["fp8-te"]
    assert te["tokens_per_s"] is None and te["status"].startswith("skipped")
    if not backend_installed("te"):
        assert "transformer-engine[pytorch]" in te["status"]
