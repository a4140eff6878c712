"""`pretrain status RUN_DIR`: where a run stands, read from its run dir (and SLURM).

For a run dir: the recipe, the last step and its loss, validation loss and tokens/s, the
time left at the current step time, the newest complete checkpoint, the preempted marker,
the goodput and where the run's wall time went, the actions taken on NaNs and loss
spikes, the nodes and world size each job ran on (a job that lost nodes went on with
fewer), who holds the lock, and the SLURM job's
state with its pending reason. For a sweep dir (the parent of the points' run dirs): one
row per point.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TextIO

from pretrain.core.inputs.reading import (
    ReadError,
    integer,
    json_objects,
    mapping,
    number,
    read_text,
    read_yaml,
    text,
)
from pretrain.core.run.checkpoint_files import complete_checkpoints
from pretrain.core.run.durations import eta_seconds, format_duration
from pretrain.core.run.goodput import breakdown
from pretrain.core.run.ledger import read_ledger
from pretrain.core.run.rundir import (
    CHECKPOINTS_DIR,
    CONFIG_FILE,
    FAULTS_FILE,
    GOODPUT_FILE,
    METRICS_FILE,
    PREEMPTED_MARKER,
    SLURM_JOB_FILE,
)
from pretrain.launcher.output import get_logger

LOG = get_logger(__name__)


def _last_rows(run_dir: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The last metrics row with a step, and the last one with a validation loss ({} when
    none); a row that is not a JSON object with a whole step (cut by a crash) is skipped."""
    path = run_dir / METRICS_FILE
    last: dict[str, Any] = {}
    last_val: dict[str, Any] = {}
    if not path.exists():
        return last, last_val
    rows, _ = json_objects(path, "the run's metrics.jsonl (one JSON object per line)")
    for row in rows:
        try:
            if integer(row.get("step"), path, "step") is None:
                continue
        except ReadError:
            continue
        last = row
        if number(row.get("val_loss")) is not None:
            last_val = row
    return last, last_val


def goodput_line(run_dir: Path) -> str:
    """Where the run's wall time went so far (core/run/goodput.py), or - before any step."""
    path = run_dir / GOODPUT_FILE
    if not path.exists():
        return "-"
    events, _ = json_objects(path, "the run's goodput.jsonl (one JSON object per line)")
    return breakdown(events).line().removeprefix("goodput ")


def hosts_line(run_dir: Path) -> str:
    """Where the run's jobs ran: the hosts and world size from the ledger, and each change
    with the step it resumed from (a lost node, a new layout), or - before any job."""
    ledger = read_ledger(run_dir)
    jobs = [r for r in (ledger[0] if ledger else []) if r.get("kind") == "job"]
    shown: list[str] = []
    where = None
    for job in jobs:
        hosts = ",".join(str(h) for h in job.get("hosts") or []) or "?"
        now = (hosts, job.get("world_size"))
        if now != where:
            prefix = f"from step {job.get('start_step')}: " if shown else ""
            shown.append(f"{prefix}{hosts} (world {job.get('world_size')})")
            where = now
    return "; ".join(shown) or "-"


def faults_line(run_dir: Path) -> str:
    """How many actions the NaN and spike policies took, and the last one; - when none."""
    path = run_dir / FAULTS_FILE
    if not path.exists():
        return "-"
    actions, _ = json_objects(path, "the run's faults.jsonl (one JSON object per line)")
    if not actions:
        return "-"

    def step(value: Any) -> str:
        return str(value) if type(value) is int else "?"

    last = actions[-1]
    action = text(last.get("action"), "?")
    what = f"step {step(last.get('step'))}: {text(last.get('trigger'), '?')} {action}"
    if action == "rollback":
        what += f" to step {step(last.get('to'))}"
    return f"{len(actions)} action{'s' * (len(actions) != 1)}, the last {what}"


def slurm_state(run_dir: Path) -> str:
    """`JOB_ID STATE (Reason=...)` of the run dir's last SLURM job, or why it is unknown."""
    from pretrain.launcher.job.backends import LaunchError, show_job

    path = run_dir / SLURM_JOB_FILE
    if not path.is_file():
        return "-"
    job_id = read_text(path, "the SLURM job id the launcher wrote", 4096).strip()
    if not job_id.isdigit():
        return f"unknown: {path} holds no job id"
    try:
        fields = show_job(job_id)
    except LaunchError as err:
        return f"{job_id} (unknown: {str(err).splitlines()[0][:80]})"
    reason = fields.get("Reason", "None")
    return f"{job_id} {fields['JobState']}" + ("" if reason == "None" else f" (Reason={reason})")


def run_status(run_dir: Path) -> dict[str, str]:
    """The status fields of one run dir, as text."""
    from pretrain.core.run.run_lock import holder_alive, read_holder

    config_path = run_dir / CONFIG_FILE
    expected = "the run's config.yaml (a mapping of the recipe's fields)"
    config = mapping(read_yaml(config_path, expected), config_path, expected)
    train = mapping(config.get("train"), config_path, "train: a mapping of fields")
    total = integer(train.get("steps"), config_path, "train.steps", 0) or 0
    last, last_val = _last_rows(run_dir)
    step = integer(last.get("step"), run_dir / METRICS_FILE, "step", 0) or 0
    eta = eta_seconds(step, total, number(last.get("step_time_s")))
    checkpoints = complete_checkpoints(run_dir / CHECKPOINTS_DIR)
    try:
        holder = read_holder(run_dir)
    except ValueError:
        holder = None
    alive = holder_alive(holder) if holder is not None else None
    lock = (
        "-"
        if holder is None
        else f"{holder.host} pid {holder.pid}" + (" (gone)" if alive is False else "")
    )
    return {
        "recipe": text(config.get("name"), "?"),
        "step": f"{step}/{total}",
        "loss": _number(last.get("loss"), ".4f"),
        "val loss": _number(last_val.get("val_loss"), ".4f"),
        "tokens/s": _number(last.get("tokens_per_s"), ",.0f"),
        "ETA": "done" if total and step >= total else format_duration(eta) if eta else "-",
        "checkpoint": f"step {checkpoints[-1][0]}" if checkpoints else "-",
        "preempted": "yes" if (run_dir / PREEMPTED_MARKER).exists() else "no",
        "goodput": goodput_line(run_dir),
        "faults": faults_line(run_dir),
        "hosts": hosts_line(run_dir),
        "lock": lock,
        "slurm": slurm_state(run_dir),
    }


def _number(value: Any, spec: str) -> str:
    finite = number(value)
    return "-" if finite is None else format(finite, spec)


def render_status(path: Path, stream: TextIO | None = None) -> str:
    """The status of a run dir (a two-column table of its fields), or one row per point of
    a sweep dir, rendered for `stream` (launcher/tables.py)."""
    from pretrain.launcher.tables import new_table, render

    if (path / CONFIG_FILE).exists():
        table = new_table("field", "value", header=False)
        for key, value in run_status(path).items():
            table.add_row(key, value)
        return render(table, stream, heading=str(path))
    points = sorted(p for p in path.iterdir() if (p / CONFIG_FILE).is_file())
    if not points:
        raise FileNotFoundError(f"{path} holds no {CONFIG_FILE}, nor run dirs that do")
    columns = ["step", "loss", "val loss", "ETA", "checkpoint", "slurm"]
    right = {"step", "loss", "val loss"}
    table = new_table(
        "point",
        *((c, "right" if c in right else "left") for c in columns),
    )
    for point in points:
        status = run_status(point)
        table.add_row(point.name, *(status[c] for c in columns))
    return render(table, stream, heading=f"{path}: {len(points)} points")


def main(argv: list[str]) -> int:
    """`pretrain status RUN_DIR [RUN_DIR ...]`: print each one's status; 2 for a bad path."""
    from pretrain.launcher.output import set_verbosity

    argv = set_verbosity(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: pretrain status [-q | -v] RUN_DIR [RUN_DIR ...]  (a run dir or a sweep dir)")
        return 0 if argv else 2
    code = 0
    for raw in argv:
        try:
            print(render_status(Path(raw)))
        except (OSError, ValueError) as err:
            LOG.error(f"pretrain status {raw}: {err}")
            code = 2
    return code
