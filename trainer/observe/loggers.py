"""Where metrics go: a console line, RUN_DIR/metrics.jsonl and Weights & Biases (main rank only).

Metric names are flat and the same in every sink (loss, lr, grad_norm, tokens_per_s, mfu...);
W&B groups them into sections through WANDB_KEYS. The main run records node 0's system
metrics; the first local rank of every other node records its node's in a run of its own in
the same group (`<name>-nodeN`, job_type node-system, system metrics labelled nodeN): W&B's
shared mode would put them in one run, but it works online only, and these work offline too.
"""

from __future__ import annotations

import json
import os
import secrets
import statistics
import string
import time
from collections import deque
from pathlib import Path
from types import TracebackType
from typing import Any

from rich.console import Console
from rich.markup import escape

from pretrain.core.inputs.reading import MissingFile, ReadError, open_binary, read_text
from pretrain.core.problems import install_fix, installed
from pretrain.core.run.durations import eta_seconds, format_duration
from pretrain.core.run.goodput import Breakdown
from pretrain.core.run.metric_names import WANDB_KEYS, wandb_key
from pretrain.core.run.rundir import METRICS_FILE, TENSORBOARD_DIR, WANDB_ID_FILE
from pretrain.core.run.wandb_credentials import api_key_configured as wandb_api_key_configured
from pretrain.core.run.wandb_credentials import wandb_project
from pretrain.core.schema import LoggingConfig
from pretrain.trainer.observe.run_identity import RunIdentity
from pretrain.trainer.observe.run_summary import RunSummary

WANDB_STEP = "train/step"
WANDB_MODES = ("auto", "online", "offline", "disabled")
MAX_RUN_ID_BYTES = 256
"""Bound of a W&B run id file read (an id is 8 characters here, at most 128 in W&B)."""
NODE_JOB_TYPE = "node-system"
"""W&B job_type of the runs that hold another node's system metrics."""
ETA_WINDOW = 20
"""Logged step times the ETA takes the median of: one slow step (a save, an evaluation's
neighbour, a page fault) moves it little, a lasting change of pace moves it in a few lines."""


def node_wandb_dir(run_dir: Path, node: int) -> Path:
    """Where node `node`'s W&B run lives (its id file, its offline files)."""
    return Path(run_dir) / "wandb" / f"node{node}"


def read_run_id(path: Path) -> str | None:
    """The W&B run id kept in `path`; None when there is none. What is not an id (letters,
    digits, `-` and `_`: W&B's alphabet) is a ReadError naming the file."""
    try:
        run_id = read_text(path, "a W&B run id", MAX_RUN_ID_BYTES).strip()
    except MissingFile:
        return None
    if run_id and not run_id.replace("-", "").replace("_", "").isalnum():
        found = f"holds {run_id[:40]!r}"
        raise ReadError(path, found, "a W&B run id", "delete it to start a new W&B run")
    return run_id or None


def stored_run_id(path: Path) -> str:
    """The W&B run id kept in `path`, created on first use (so a resumed run continues it)."""
    run_id = read_run_id(path)
    if run_id:
        return run_id
    # W&B run ids: lowercase letters and digits; 8 random ones like W&B's own.
    run_id = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(run_id + "\n")
    os.replace(tmp, path)
    return run_id


class WandbRunId:
    """The run dir's W&B run id as a checkpoint holds it (a string, or None before W&B ever
    ran), so that a resumed run continues the same W&B run even if the run dir lost the id
    file; the main rank writes it back."""

    def __init__(self, run_dir: Path, is_main: bool) -> None:
        self.path = Path(run_dir) / WANDB_ID_FILE
        self.is_main = is_main

    def state_dict(self) -> str | None:
        return read_run_id(self.path)

    def load_state_dict(self, run_id: str | None) -> None:
        if self.is_main and run_id and not self.path.exists():
            self.path.write_text(run_id + "\n")


def resolve_wandb_mode(setting: str) -> str:
    """online, offline or disabled for a `logging.wandb` setting.

    auto is disabled where the wandb package is not installed (the `wandb` extra); else it
    honours an explicit WANDB_MODE in the environment, else goes online with credentials and
    offline without.
    """
    if setting not in WANDB_MODES:
        raise ValueError(f"logging.wandb={setting!r}: use {', '.join(WANDB_MODES)}")
    if setting != "auto":
        return setting
    if not installed("wandb"):
        return "disabled"
    env = os.environ.get("WANDB_MODE", "").lower()
    if env in ("online", "offline", "disabled"):
        return env
    if env == "dryrun":
        return "offline"
    return "online" if wandb_api_key_configured() else "offline"


def truncate_partial_line(path: Path) -> None:
    """Cut a trailing line that has no newline (a write interrupted by a crash)."""
    if not path.exists():
        return
    keep = 0
    with open_binary(path, "the run's metrics.jsonl") as f:
        end = pos = f.seek(0, os.SEEK_END)
        # Read backwards in blocks until the last newline: the file may be large.
        while pos > 0:
            size = min(65536, pos)
            f.seek(pos - size)
            block = f.read(size)
            if pos == end and block.endswith(b"\n"):
                return
            newline = block.rfind(b"\n")
            if newline >= 0:
                keep = pos - size + newline + 1
                break
            pos -= size
    os.truncate(path, keep)


def _plain(value: Any) -> Any:
    """A JSON-ready number: 0-d tensors and numpy scalars become Python numbers."""
    return value.item() if hasattr(value, "item") else value


STABILITY_CONSOLE = (
    ("max attn logit", "attn_logit_max"),
    ("z-mean", "z_mean"),
    ("max update/weight", "update_ratio_max"),
    ("max act rms", "act_rms_max"),
)
"""The stability summaries a sampled step's console line shows (label, monitor)."""


def console_line(step: int, total_steps: int, metrics: dict[str, Any]) -> str:
    """The one-line console summary of a logged step."""

    def has(key: str) -> bool:
        return metrics.get(key) is not None

    parts = [f"step {step}/{total_steps}"]
    if has("loss"):
        parts.append(f"loss {metrics['loss']:.4f}")
    if has("lr"):
        parts.append(f"lr {metrics['lr']:.2e}")
    if has("grad_norm"):
        parts.append(f"grad norm {metrics['grad_norm']:.3f}")
    if has("val_loss"):
        parts.append(f"val loss {metrics['val_loss']:.4f} (ppl {metrics['val_ppl']:.4g})")
    if has("tokens_per_s"):
        parts.append(f"{metrics['tokens_per_s']:,.0f} tok/s")
    if has("tflops_per_device"):
        parts.append(f"{metrics['tflops_per_device']:.3g} TFLOP/s/device")
    if has("mfu"):
        # Name the peak MFU divides by: an FP8 run is measured against the FP8 peak.
        of = f" of {metrics['peak_dtype']} peak" if has("peak_dtype") else ""
        parts.append(f"MFU {100 * metrics['mfu']:.1f}%{of}")
    else:
        parts.append("MFU n/a")
    if has("mem_peak_gib"):
        parts.append(f"mem {metrics['mem_peak_gib']:.2f} GiB")
    if has("moe_tokens_per_expert_mean"):
        parts.append(
            f"experts load {metrics['moe_tokens_per_expert_min']:.0f}/"
            f"{metrics['moe_tokens_per_expert_mean']:.0f}/{metrics['moe_tokens_per_expert_max']:.0f}"
            f" min/mean/max, dropped {metrics['moe_dropped_frac']:.1%}, "
            f"aux {metrics['moe_aux_loss']:.3f}"
        )
    if has("loss_scale"):
        parts.append(f"loss scale {metrics['loss_scale']:g} ({metrics['skipped_steps']} skipped)")
    for key, value in metrics.items():
        if key.startswith("eval/") and key.endswith("/acc") and value is not None:
            norm = metrics.get(key + "_norm")
            normed = f" (norm {norm:.3f})" if norm is not None else ""
            parts.append(f"{key[5:-4]} acc {value:.3f}{normed}")
    stability = [
        (label, metrics.get(f"stability/{name}"))
        for label, name in STABILITY_CONSOLE
        if metrics.get(f"stability/{name}") is not None
    ]
    if stability:
        parts.append(", ".join(f"{label} {value:.3g}" for label, value in stability))
    return " | ".join(parts)


class MetricsLogger:
    """Logs metrics of the main rank to the console, RUN_DIR/metrics.jsonl and W&B.

    Other ranks construct it too and do nothing. The caller decides which steps to log (the
    metrics window applies `logging.log_every`). A W&B failure warns and leaves the other sinks.
    """

    def __init__(
        self,
        run_dir: Path,
        *,
        is_main: bool,
        logging: LoggingConfig,
        config: dict,
        identity: RunIdentity,
        total_steps: int,
        node: int | None = None,
    ) -> None:
        """`node`: on a rank other than the main one, the node whose system metrics it
        records in a W&B run of its own (the first local rank of each node but the first)."""
        self.run_dir = Path(run_dir)
        self.is_main = is_main
        self.logging = logging
        self.total_steps = total_steps
        self.console = Console(highlight=False, soft_wrap=True)
        self._file = None
        self._wandb_run = None
        self._wandb_mode = "disabled"
        self._tensorboard: Any = None
        self.summary = RunSummary()
        self._step_times: deque[float] = deque(maxlen=ETA_WINDOW)
        mode = resolve_wandb_mode(logging.wandb)  # on every rank: a bad setting fails everywhere
        if not is_main:
            if node is not None and mode != "disabled":
                self._init_node_wandb(mode, identity, node)
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        jsonl = self.run_dir / METRICS_FILE
        truncate_partial_line(jsonl)
        self.summary.read_history(jsonl)
        self._file = jsonl.open("a", encoding="utf-8")
        if mode != "disabled":
            self._init_wandb(mode, config, identity)
        elif logging.wandb == "auto" and not installed("wandb"):
            line = f"W&B off: the wandb package is not installed ({install_fix('wandb')})"
            self.console.print(line, markup=False)  # the extra's [brackets] are not markup
        if logging.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tensorboard = SummaryWriter(str(self.run_dir / TENSORBOARD_DIR))

    def wandb_run_id(self) -> str:
        """The W&B run id of this run dir, created on first use and kept in RUN_DIR/wandb_run_id."""
        return stored_run_id(self.run_dir / WANDB_ID_FILE)

    def _init_node_wandb(self, mode: str, identity: RunIdentity, node: int) -> None:
        """A run of this node's system metrics only, beside the main run in its group."""
        os.environ.setdefault("WANDB_SILENT", "true")
        folder = node_wandb_dir(self.run_dir, node)
        try:
            import wandb

            self._wandb_run = wandb.init(
                project=wandb_project(self.logging.wandb_project),
                entity=self.logging.wandb_entity or None,
                name=f"{identity.name}-node{node}",
                group=identity.group,
                job_type=NODE_JOB_TYPE,
                tags=identity.tags,
                id=stored_run_id(folder / "run_id"),
                resume="allow",
                dir=str(folder),
                mode=mode,
                # The main run has the console; this one only samples the node.
                settings=wandb.Settings(silent=True, console="off", x_label=f"node{node}"),
            )
        except Exception as exc:  # whatever W&B raises, training must go on
            reason = escape(f"{type(exc).__name__}: {exc}")
            self.console.print(f"[yellow]W&B system metrics of node {node} disabled: {reason}")
            return
        self._wandb_mode = mode

    def _init_wandb(self, mode: str, config: dict, identity: RunIdentity) -> None:
        os.environ.setdefault("WANDB_SILENT", "true")
        try:
            import wandb

            run = wandb.init(
                project=wandb_project(self.logging.wandb_project),
                entity=self.logging.wandb_entity or None,
                name=identity.name,
                group=identity.group,
                job_type=identity.job_type,
                tags=identity.tags,
                id=self.wandb_run_id(),
                resume="allow",
                dir=str(self.run_dir),
                config={**config, "plan": identity.predicted},
                mode=mode,
                settings=wandb.Settings(silent=True),
            )
            # A custom x-axis: a resumed run may log steps again that W&B's own counter passed.
            run.define_metric(WANDB_STEP)
            run.define_metric("*", step_metric=WANDB_STEP)
            run.define_metric(WANDB_KEYS["mfu"], step_metric=WANDB_STEP, summary="max")
            run.define_metric(WANDB_KEYS["tokens_per_s"], step_metric=WANDB_STEP, summary="max")
            run.define_metric(WANDB_KEYS["loss"], step_metric=WANDB_STEP, summary="min")
            run.define_metric(WANDB_KEYS["val_loss"], step_metric=WANDB_STEP, summary="min")
            # The plan's predictions beside the measured summary values.
            run.summary.update({f"plan/{k}": v for k, v in identity.predicted.items()})
        except Exception as exc:  # whatever W&B raises, training must go on
            reason = escape(f"{type(exc).__name__}: {exc}")
            self.console.print(f"[yellow]W&B disabled ({mode}): {reason}")
            return
        self._wandb_run, self._wandb_mode = run, mode
        if mode == "offline":
            self._print_offline_hint()

    def _print_offline_hint(self) -> None:
        sync_dir = self._wandb_run.settings.sync_dir
        self.console.print(f"W&B offline run in {sync_dir}; upload with: wandb sync {sync_dir}")

    def log(self, step: int, metrics: dict[str, float | None]) -> None:
        """Write one step's metrics to every sink (main rank only); None means not measured.

        The metrics.jsonl line holds `step`, `time` (unix seconds) and every metric as given.
        """
        if not self.is_main:
            return
        values = {k: _plain(v) for k, v in metrics.items()}
        self.summary.observe(step, values)
        line = console_line(step, self.total_steps, values)
        eta = eta_seconds(step, self.total_steps, self._smoothed_step_time(values))
        if eta is not None:
            line += f" | ETA {format_duration(eta)}"
        self.console.print(line, markup=False)
        record = {"step": step, "time": round(time.time(), 3), **values}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tensorboard is not None:
            for k, v in values.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    self._tensorboard.add_scalar(wandb_key(k), v, step)
            self._tensorboard.flush()
        if self._wandb_run is not None:
            data = {wandb_key(k): v for k, v in values.items() if v is not None}
            try:
                self._wandb_run.log({WANDB_STEP: step, **data})
            except Exception as exc:  # losing W&B mid-run must not stop training
                self.console.print(f"[yellow]W&B log failed, W&B disabled: {escape(str(exc))}")
                self._wandb_run = None

    def event(self, record: dict[str, Any]) -> None:
        """One action on a bad step (main rank): a console line, and a point of
        `faults/<trigger>_<action>` in W&B and TensorBoard at its step."""
        if not self.is_main:
            return
        step, key = record["step"], f"faults/{record['trigger']}_{record['action']}"
        line = f"step {step}: {record['detail']}: {record['action']}"
        if record["action"] == "rollback":
            first, last = record["skipped_batches"]
            line += f" to the checkpoint of step {record['to']}, batches {first}..{last} skipped"
            if record["lr_until"]:
                line += f", lr x{record['lr_factor']:g} until step {record['lr_until']}"
        self.console.print(f"[faults] {line}", markup=False)
        if self._tensorboard is not None:
            self._tensorboard.add_scalar(key, 1, step)
            self._tensorboard.flush()
        if self._wandb_run is not None:
            try:
                self._wandb_run.log({WANDB_STEP: step, key: 1})
            except Exception as exc:  # losing W&B mid-run must not stop training
                self.console.print(f"[yellow]W&B log failed, W&B disabled: {escape(str(exc))}")
                self._wandb_run = None

    def alert(self, step: int, title: str, text: str) -> None:
        """A monitor crossed its threshold (main rank): a warning line, and a W&B alert
        (WARN; W&B sends one of a title at most every minute)."""
        if not self.is_main:
            return
        self.console.print(f"[stability] warning: {text}", markup=False)
        if self._wandb_run is not None:
            try:
                import wandb

                self._wandb_run.alert(title=title[:63], text=text, level=wandb.AlertLevel.WARN)
            except Exception as exc:  # losing W&B mid-run must not stop training
                self.console.print(f"[yellow]W&B alert failed: {escape(str(exc))}")

    def _smoothed_step_time(self, values: dict[str, Any]) -> float | None:
        """The median of the last ETA_WINDOW logged step times, this row's included."""
        step_time = values.get("step_time_s")
        if isinstance(step_time, (int, float)) and step_time > 0:
            self._step_times.append(float(step_time))
        return statistics.median(self._step_times) if self._step_times else None

    def print_summary(
        self,
        *,
        tokens: int,
        wall_s: float,
        checkpoint: Path | None,
        goodput: Breakdown | None = None,
    ) -> None:
        """Print the end-of-run block (main rank only): see trainer/observe/run_summary.py."""
        if not self.is_main:
            return
        lines = self.summary.lines(
            tokens=tokens, wall_s=wall_s, checkpoint=checkpoint, run_dir=self.run_dir,
            goodput=goodput,
        )  # fmt: skip
        self.console.print("\n".join(lines), markup=False)

    def close(self, exit_code: int = 0) -> None:
        """Flush and close every sink; safe to call more than once."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None
        if self._wandb_run is not None:
            run, self._wandb_run = self._wandb_run, None
            try:
                run.finish(exit_code=exit_code)
            except Exception as exc:
                self.console.print(f"[yellow]W&B finish failed: {escape(str(exc))}")
                return
            if self._wandb_mode == "offline":
                self.console.print(
                    f"W&B offline run saved; upload with: wandb sync {run.settings.sync_dir}"
                )

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close(exit_code=0 if exc_type is None else 1)
