"""`pretrain action=plan` for a pipelined recipe shows the schedule chart and its bubble."""

from __future__ import annotations

from pathlib import Path

import pytest

from pretrain.launcher.plan.pipeline.schedule_sim import simulate
from tests.helpers import pretrain

pytestmark = pytest.mark.e2e


def test_llama3_70b_plan_prints_the_schedule_chart_and_bubble(tmp_path: Path) -> None:
    result = pretrain("--config-name", "llama3_70b", "cluster.nodes=8", "action=plan", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    # The recipe: pp=4 under 1F1B, 256 sequences over dp=2 at micro-batch 1.
    pp, microbatches = 4, 128
    full = simulate("1f1b", pp, microbatches)
    assert f"Pipeline schedule: 1f1b, {microbatches} micro-batches" in result.stdout
    assert f"bubble (simulated): {full.bubble_fraction:.1%}" in result.stdout
    assert f"for {2 * pp} of the {microbatches} micro-batches" in result.stdout
    chart = simulate("1f1b", pp, 2 * pp).chart()
    assert chart in result.stdout
