"""The actions of `faults.on_nan`, `faults.on_spike` and `faults.on_alert` as the loop takes
them: each one audited (RUN_DIR/faults.jsonl, the main rank) and sent to the metrics sinks,
a rollback carried out, and the learning rate lowered after one (see trainer/faults/policies.py).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Protocol

from pretrain.core.schema import FaultConfig
from pretrain.trainer.checkpoint.checkpointer import Checkpointer
from pretrain.trainer.faults.policies import after_rollbacks, read_audit, write_audit
from pretrain.trainer.faults.step_guard import StepGuard, TooManyBadSteps
from pretrain.trainer.log import get_logger
from pretrain.trainer.observe.goodput import GoodputLedger
from pretrain.trainer.observe.loggers import MetricsLogger
from pretrain.trainer.step.state import TrainState


class Positioned(Protocol):
    """A loader whose position (batches drawn) is part of its state."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def _move_to(loader: Positioned, position: int) -> None:
    """Put `loader` at `position` (batches drawn), keeping what its state is valid for."""
    state = loader.state_dict()
    state["step"] = position
    loader.load_state_dict(state)


class Recovery:
    """Audits the policies' actions and carries out rollbacks; the same calls on every rank."""

    def __init__(
        self, run_dir: Path, is_main: bool, faults: FaultConfig, metrics: MetricsLogger
    ) -> None:
        self.run_dir = Path(run_dir)
        self.is_main = is_main
        self.faults = faults
        self.metrics = metrics
        self.audit = read_audit(self.run_dir)
        self.lr_factor, self.lr_until = 1.0, 0

    def resumed(self, start: int, loader: Positioned) -> None:
        """The run restored the checkpoint of `start`: skip again the data a rollback to it
        skipped, and lower the rate of steps a rollback lowered."""
        after = after_rollbacks(self.audit, start)
        if after.data_position is not None:
            _move_to(loader, after.data_position)
            get_logger().info(
                "data resumes after batch %d of the data order, as the rollback to step %d "
                "left it",
                after.data_position, start,
            )  # fmt: skip
        self.lr_factor, self.lr_until = after.lr_factor, after.lr_until

    def action(self, record: dict[str, Any]) -> None:
        """Audit one action (main rank) and send it to the metrics sinks."""
        self.audit.append(record)
        if self.is_main:
            write_audit(self.run_dir, record)
        self.metrics.event(record)

    def scale_lr(self, step: int, state: TrainState) -> None:
        """Set the rate of `step`: the schedule's, times the factor in a lowered window."""
        if not self.lr_until:
            return
        factor = self.lr_factor if step <= self.lr_until else 1.0
        for group, scheduled in zip(
            state.optimizer.param_groups, state.scheduler.get_last_lr(), strict=True
        ):
            group["lr"] = scheduled * factor

    def roll_back(
        self,
        step: int,
        guard: StepGuard,
        checkpointer: Checkpointer,
        loader: Positioned,
        goodput: GoodputLedger,
    ) -> int:
        """Reload the newest checkpoint after bad step `step` and move the data past its
        batch; the step of the checkpoint, from which the loop goes on."""
        detail = guard.detail or "non-finite loss or gradient norm"
        position = int(loader.state_dict()["step"])  # the batch after this step's
        checkpointer.wait()
        began = time.time()
        restored = checkpointer.restore()
        if restored == 0:
            raise TooManyBadSteps(
                f"step {step}: {detail} (faults.on_{guard.trigger}=rollback), and no "
                "checkpoint was written yet to roll back to; lower checkpoint.every, or use "
                "skip until the first one"
            )
        # The skipped batches as the steps they belonged to in the data order, inclusive.
        again = sum(r.get("action") == "rollback" and r.get("to") == restored for r in self.audit)
        if again >= self.faults.max_bad_steps:
            raise TooManyBadSteps(
                f"step {step}: {detail}; the run rolled back to the checkpoint of step "
                f"{restored} {again} times already (faults.max_bad_steps="
                f"{self.faults.max_bad_steps}): skipping data does not help. Resume with a "
                "lower optim.lr or more warmup"
            )
        skipped = [int(loader.state_dict()["step"]) + 1, position]
        _move_to(loader, position)
        lowered = self.faults.rollback_lr_steps > 0 and self.faults.rollback_lr_factor < 1
        if lowered:
            self.lr_factor = self.faults.rollback_lr_factor
            self.lr_until = restored + self.faults.rollback_lr_steps
        goodput.rolled_back(restored, time.time() - began)
        self.action(
            {"step": step, "trigger": guard.trigger, "action": "rollback", "detail": detail,
             "to": restored, "data_position": position, "skipped_batches": skipped,
             "lr_factor": self.lr_factor if lowered else 1.0,
             "lr_until": self.lr_until if lowered else 0}
        )  # fmt: skip
        return restored
