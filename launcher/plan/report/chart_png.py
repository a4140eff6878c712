"""The simulated pipeline schedule drawn as a picture (`plan.chart=png`): one row per stage,
one cell per time slot, coloured by what the stage computes (F forward, B backward, W the
weight-gradient half of a split backward, blank idle), labelled with the micro-batch (and
the chunk, a or b, of a virtual stage).

Drawn from the plan's text chart, which every schedule the simulator knows prints the same
way, so the picture and the text can never disagree. The PNG carries the parsed cells (its
`pretrain-chart` text chunk, JSON), so a test reads back what was drawn.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PNG_DATA_KEY = "pretrain-chart"
COLOURS = {"F": "#4C72B0", "B": "#DD8452", "W": "#55A868"}
"""Cell colour by action; a second chunk (b) is drawn lighter."""
_ROW = re.compile(r"^stage\s+(\d+)\s*\|\s?(.*)$")
_CELL = re.compile(r"^([FBW])(\d+)([a-z]?)$")


@dataclass(frozen=True)
class Cell:
    """One time slot of one stage: its action (F, B or W), micro-batch and chunk; an idle
    slot has action ''."""

    stage: int
    slot: int
    action: str
    microbatch: int = -1
    chunk: str = ""


def parse_chart(chart: str) -> list[list[Cell]]:
    """The rows of a text chart (`stage  0 | F0 F1 .  B0 ...`), one list of cells per stage."""
    rows = []
    for line in chart.splitlines():
        match = _ROW.match(line.rstrip())
        if match is None:
            raise ValueError(f"not a row of a pipeline chart: {line!r}")
        stage = int(match.group(1))
        cells = []
        for slot, token in enumerate(match.group(2).split()):
            cell = _CELL.match(token)
            if cell is None:
                cells.append(Cell(stage, slot, ""))
            else:
                action, micro, chunk = cell.groups()
                cells.append(Cell(stage, slot, action, int(micro), chunk))
        rows.append(cells)
    return rows


def draw_chart(pipeline: dict[str, Any], out: Path, title: str) -> Path:
    """Draw the plan's pipeline (`Plan.pipeline`) into `out` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch, Rectangle

    rows = parse_chart(pipeline["chart"])
    slots = max(len(r) for r in rows)
    fig = Figure(figsize=(min(24, max(6, 0.42 * slots)), 0.55 * len(rows) + 1.4), dpi=100,
                 layout="constrained")  # fmt: skip
    ax = fig.subplots()
    for cells in rows:
        for cell in cells:
            if not cell.action:
                continue
            alpha = 0.55 if cell.chunk == "b" else 1.0
            y = len(rows) - 1 - cell.stage
            ax.add_patch(Rectangle((cell.slot, y), 0.95, 0.9, color=COLOURS[cell.action],
                                   alpha=alpha))  # fmt: skip
            ax.text(cell.slot + 0.47, y + 0.45, f"{cell.microbatch}{cell.chunk}",
                    ha="center", va="center", fontsize=7, color="white")  # fmt: skip
    ax.set_xlim(0, slots)
    ax.set_ylim(0, len(rows))
    ax.set_yticks([len(rows) - 1 - i + 0.45 for i in range(len(rows))],
                  [f"stage {i}" for i in range(len(rows))])  # fmt: skip
    ax.set_xlabel("time slot")
    handles = [Patch(color=c, label=a) for a, c in COLOURS.items()
               if any(cell.action == a for row in rows for cell in row)]  # fmt: skip
    ax.legend(handles=handles, loc="lower right", bbox_to_anchor=(1.0, 1.0), fontsize="small",
              ncols=len(handles), frameon=False)  # fmt: skip
    bubble = pipeline.get("charted_bubble_fraction", pipeline.get("bubble_fraction", 0.0))
    ax.set_title(f"{title}: {pipeline['schedule']}, {pipeline['charted_microbatches']} "
                 f"micro-batches, bubble {bubble:.1%}", loc="left")  # fmt: skip
    data = json.dumps(
        {
            "schedule": pipeline["schedule"],
            "rows": [[[c.action, c.microbatch, c.chunk] for c in r] for r in rows],
        }
    )
    fig.savefig(out, format="png", metadata={PNG_DATA_KEY: data})
    return out
