"""plan.chart=png: the simulated pipeline schedule drawn as a picture, its cells read back
from the PNG and compared with the plan's own text chart."""

from __future__ import annotations

import json
from pathlib import Path

from PIL import Image

from pretrain.launcher.plan.report.chart_png import PNG_DATA_KEY, Cell, parse_chart
from tests.helpers import pretrain_in_process

ZBV = ["--config-name", "tiny", "parallel.pp=2", "parallel.vpp=2", "parallel.pp_schedule=zbv",
       "eval.every=0", "cluster.gpus_per_node=2", "action=plan"]  # fmt: skip


def test_a_text_chart_parses_into_cells_per_stage_and_slot() -> None:
    rows = parse_chart("stage  0 | F0a F1a  .  W0b\nstage  1 |  .  F0a B0b B0b")
    assert [len(r) for r in rows] == [4, 4]
    assert rows[0][0] == Cell(0, 0, "F", 0, "a") and rows[0][2] == Cell(0, 2, "")
    assert rows[1][3] == Cell(1, 3, "B", 0, "b")


def test_the_drawn_chart_holds_every_cell_of_the_plans_chart(tmp_path: Path) -> None:
    code, out, err = pretrain_in_process(*ZBV, "plan.format=json", "plan.chart=png", cwd=tmp_path)
    assert code == 0, err
    png = tmp_path / "pipeline.png"
    assert f"pipeline chart: {png}" in err
    pipeline = json.loads(out)["pipeline"]  # stdout is still one JSON object
    with Image.open(png) as image:
        drawn = json.loads(image.text[PNG_DATA_KEY])
        assert image.width > 600
    assert drawn["schedule"] == "zbv"
    expected = [[[c.action, c.microbatch, c.chunk] for c in row]
                for row in parse_chart(pipeline["chart"])]  # fmt: skip
    assert drawn["rows"] == expected
    actions = {cell[0] for row in drawn["rows"] for cell in row}
    assert actions == {"F", "B", "W", ""}  # zbv splits the backward: W cells, and a bubble


def test_a_chart_is_refused_without_a_pipeline_or_outside_action_plan(tmp_path: Path) -> None:
    code, _, err = pretrain_in_process("action=plan", "plan.chart=png", cwd=tmp_path)
    assert code == 2 and "has parallel.pp=1 and no pipeline to chart" in err
    code, _, err = pretrain_in_process(*ZBV[:-1], "action=script", "plan.chart=png",
                                       cwd=tmp_path)  # fmt: skip
    assert code == 2 and "the chart is drawn by action=plan, not action=script" in err
    assert list(tmp_path.iterdir()) == []
