"""`pretrain action=suggest` as a user runs it: a table or JSON of layouts that fit."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.helpers import pretrain

pytestmark = pytest.mark.e2e


def test_suggest_prints_the_five_fastest_layouts_with_why_and_writes_nothing(tmp_path: Path):
    result = pretrain("--config-name", "llama3_70b", "action=suggest", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("Layouts for llama3_70b on 8 x 8 h100_sxm (80 GiB)")
    header = re.split(r"\s{2,}", lines[2].strip())
    assert header[:3] == ["#", "tp", "sp"] and header[-4:] == ["step s", "tok/s", "MFU", "peak GiB"]
    rows = [re.split(r"\s{2,}", line.strip()) for line in lines[4:9]]
    assert [row[0] for row in rows] == ["1", "2", "3", "4", "5"] and lines[9] == ""
    times = [float(row[header.index("step s")]) for row in rows]
    assert times == sorted(times)  # the fastest first
    assert [line for line in lines if re.fullmatch(r"#\d+", line)] == [f"#{i}" for i in range(1, 6)]
    assert sum(line.startswith("   why: compute") for line in lines) == 5
    assert sum(line.startswith("   use: parallel.tp=") for line in lines) == 5
    assert list(tmp_path.iterdir()) == []


def test_suggest_as_json_ignores_the_recipes_own_invalid_layout(tmp_path: Path):
    # 80 layers cannot split over pp=3: a plan is refused, the search picks its own layout.
    refused = pretrain("--config-name", "llama3_70b", "parallel.pp=3", "action=plan", cwd=tmp_path)
    assert refused.returncode == 2 and "parallel.pp=3" in refused.stderr
    result = pretrain(
        "--config-name",
        "llama3_70b",
        "parallel.pp=3",
        "action=suggest",
        "suggest.top=3",
        "plan.format=json",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout)
    assert found["world"] == 64 and found["fitting"] >= 3
    times = [s["step_time_s"] for s in found["suggestions"]]
    assert len(times) == 3 and times == sorted(times)
    for s in found["suggestions"]:
        assert s["peak_gib"] < found["device_memory_gib"]
        stages = s["pp"] * s["vpp"]
        assert s["tp"] <= 8
        # Stages that do not divide the 80 layers come with their split.
        split = s["pp_layers"] or [80 // stages] * stages
        assert len(split) == stages and sum(split) == 80
