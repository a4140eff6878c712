"""The launcher's short account of a failed local run, from the ranks' failure records.

Each rank that fails writes RUN_DIR/logs/failure_rank_R.json (cause, fix, host; the full
traceback goes to logs/rank_R.log; `trainer/faults/failure_report.py`). The first failure of the
last attempt is the cause; ranks that only lost their peers after it are counted, not
described.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pretrain.core.inputs.reading import ReadError, number, read_json
from pretrain.core.run.rundir import FAILURE_RECORD_GLOB, LAUNCH_LOG, LOGS_DIR

SECONDARY = frozenset({"peer", "stopped"})
"""Kinds of failure that follow another rank's (a lost connection, a forwarded signal)."""


def read_failures(run_dir: Path) -> list[dict[str, Any]]:
    """Every readable failure record of the run dir, first failure first."""
    records = []
    for path in (Path(run_dir) / LOGS_DIR).glob(FAILURE_RECORD_GLOB):
        try:
            record = read_json(path, "a rank's failure record (a JSON object)")
        except ReadError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return sorted(
        records, key=lambda r: (-(number(r.get("attempt")) or 0), number(r.get("time")) or 0.0)
    )


def has_failures(run_dir: Path) -> bool:
    """Whether a rank has reported a failure."""
    return any((Path(run_dir) / LOGS_DIR).glob(FAILURE_RECORD_GLOB))


def clear_failures(run_dir: Path) -> None:
    """Forget the failure records of an earlier launch."""
    for path in (Path(run_dir) / LOGS_DIR).glob(FAILURE_RECORD_GLOB):
        path.unlink(missing_ok=True)


def failure_message(run_dir: Path, code: int) -> str:
    """What to print when torchrun exited with `code` != 0."""
    records = read_failures(run_dir)
    logs = Path(run_dir) / LOGS_DIR
    if not records:
        return (
            f"training exited with code {code} and no rank reported a cause (a rank killed "
            f"by a signal?); torchrun's messages are in {logs / LAUNCH_LOG}"
        )
    attempt = records[0].get("attempt", 0)
    records = [r for r in records if r.get("attempt", 0) == attempt]
    primary = [r for r in records if r.get("kind") not in SECONDARY] or records
    first = primary[0]
    others = sorted({r["rank"] for r in records} - {first["rank"]})
    lines = [
        f"training failed on rank {first['rank']} of {first['world_size']} "
        f"(host {first['host']}): {first['cause']}",
        f"  fix: {first['fix']}",
        f"  traceback: {first['traceback']}",
    ]
    if others:
        ranks = ", ".join(str(r) for r in others)
        lines.append(f"  then rank{'s' * (len(others) > 1)} {ranks} stopped too; see {logs}")
    return "\n".join(lines)
