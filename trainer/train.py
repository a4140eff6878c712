"""The per-rank training program: set up from the frozen config, then step and log.

Everything is built before the loop (`pretrain.trainer.setup`); the loop only calls components: the
step of the layout (timed by the metrics window; the stability monitors armed around the
steps they sample, their alerts sent to the sinks), the fault guard and injector, the
checkpointer (which decides when a save is due), the evaluator (the validation loss when
due, untimed), the metrics window (timing and the metrics dict), the metrics sinks and the
hang watchdog, told where the loop is (it measures the steps and is told the saves' and
evaluations' times, and keeps the timeouts they imply in force).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

from pretrain.core.data_order.ramps import Ramp
from pretrain.core.run import run_lock
from pretrain.core.run.checkpoint_files import find_checkpoint
from pretrain.core.run.rundir import CHECKPOINTS_DIR
from pretrain.core.schema import RecipeConfig, load_config
from pretrain.trainer.allocator import keep_freed_memory
from pretrain.trainer.dist import RankInfo, init_distributed
from pretrain.trainer.faults.step_guard import (
    install_stop_handlers,
    mark_preempted,
    stop_signal_name,
)
from pretrain.trainer.faults.timeouts import PhaseTimeouts
from pretrain.trainer.faults.watchdog import Watchdog, enable_flight_recorder
from pretrain.trainer.log import get_logger
from pretrain.trainer.observe.startup import CLOCK
from pretrain.trainer.setup import Run, setup


def train(run: Run, watchdog: Watchdog) -> None:
    """Step `run` from its start to `train.steps`, logging and checkpointing on the way."""
    total = run.cfg.train.steps
    # The job's wall time from its first stamp (the launcher's start on a local run).
    started = CLOCK.marks[0][1] if CLOCK.marks else time.time()
    run.goodput.begin(run.start, run.load_s)
    step = run.start
    get_logger().info("%s", watchdog.timeouts.start_line())
    with run.metrics as metrics:
        while step < total:
            step += 1
            watchdog.beat(step, "training")
            run.faults.begin_step(step, batch=run.loader.step + 1)
            run.recovery.scale_lr(step, run.state)
            micro_batches = run.window.wait_for_data(run.loader.next_step)
            run.state.stability.arm(step)
            result = run.window.run_step(run.stepper, micro_batches)
            sampled = run.state.stability.collect(step)
            for alert in run.state.stability.alerts:
                metrics.alert(alert.step, f"{alert.name} above {alert.threshold:g}", alert.line())
            if not CLOCK.reported:
                CLOCK.mark("first step")
                CLOCK.reported = True
                if run.rank.is_main:
                    get_logger().info("%s", CLOCK.line())
            action = run.guard.record(step, result.bad)
            if not result.bad:
                action = run.guard.alerted(step, run.state.stability.alerts)
            run.faults.after_step()
            if action == "rollback":
                # The bad step is logged as it was, then trained again from the checkpoint.
                run.goodput.step(step, 0.0, 0.0)
                metrics.log(step, {**run.window.collect(step), **sampled, **run.goodput.flush()})
                watchdog.beat(step, "checkpoint")  # the load is timed as a save is
                step = run.recovery.roll_back(
                    step, run.guard, run.checkpointer, run.loader, run.goodput
                )
                continue
            watchdog.beat(step, "checkpoint")
            save_s = _timed(run.checkpointer.after_step, step, result.stop)
            saved = run.checkpointer.saved_step == step
            if saved:
                watchdog.measured("save", save_s)
            watchdog.beat(step, "evaluation")
            evaluating = time.time()
            val = run.window.untimed(run.evaluator.after_step, step, step == total, result.stop)
            eval_s = time.time() - evaluating
            if val:
                watchdog.measured("evaluation", eval_s)
            run.goodput.step(step, save_s if saved else 0.0, eval_s)
            if val or sampled or run.window.due(step, last=step == total, stop=result.stop):
                watchdog.beat(step, "metrics")
                timeouts = watchdog.timeouts.flush()
                metrics.log(
                    step,
                    {
                        **run.window.collect(step),
                        **val,
                        **sampled,
                        **run.goodput.flush(),
                        **timeouts,
                    },
                )
            if result.stop:
                _stop_after_save(run, step)
                return
        watchdog.beat(total, "checkpoint")
        run.goodput.saved(total, _timed(run.checkpointer.finish, total))
        run.checkpointer.close()
        run.goodput.end("finished")
        metrics.print_summary(
            tokens=Ramp(run.cfg.train).tokens_before(total),
            wall_s=time.time() - started,
            checkpoint=find_checkpoint(run.run_dir / CHECKPOINTS_DIR),
            goodput=run.goodput.breakdown() if run.rank.is_main else None,
        )


def _timed(work: Callable[..., object], *args: object) -> float:
    """Seconds `work(*args)` took."""
    begun = time.time()
    work(*args)
    return time.time() - begun


def _stop_after_save(run: Run, step: int) -> None:
    """The job was asked to stop: the checkpoint of `step` is written; leave the marker the
    job script requeues on."""
    run.checkpointer.close()
    run.goodput.end("stopped")
    if run.rank.is_main:
        mark_preempted(run.run_dir, step)
    get_logger().info("stopped by %s after step %d; saved", stop_signal_name(), step)


def run(cfg: RecipeConfig, rank: RankInfo, watchdog: Watchdog) -> None:
    """Train `cfg` on this rank until `train.steps`."""
    train(setup(cfg, rank), watchdog)


def main(config_path: str) -> None:
    """Run one rank of the job described by the run dir's config.yaml; rank 0 holds the run
    dir's lock meanwhile (unless the launcher holds it for this job)."""
    CLOCK.mark("imports")
    install_stop_handlers()
    cfg = load_config(config_path)
    if cfg.cluster.device == "cpu":
        keep_freed_memory()
    run_dir = Path(cfg.run.dir)
    enable_flight_recorder(run_dir, cfg.cluster.device)
    timeouts = PhaseTimeouts(cfg.faults, measure_saves=cfg.checkpoint.async_mode == "none")
    rank = init_distributed(cfg.cluster, timeouts.limit("setup"), cfg.parallel.offload == "params")
    CLOCK.mark("process group")
    if cfg.action == "calibrate":
        # A calibration job trains nothing: it measures, times its layouts and ends.
        from pretrain.trainer.calibrate import calibrate

        try:
            calibrate(cfg, rank)
            dist.barrier()
        finally:
            dist.destroy_process_group()
        return
    try:
        with (
            run_lock.held(cfg.run.dir, enabled=rank.is_main) as took_over,
            Watchdog(run_dir, rank.rank, rank.world_size, timeouts) as watchdog,
        ):
            if took_over:
                get_logger().warning("run dir %s: %s", cfg.run.dir, took_over)
            try:
                run(cfg, rank, watchdog)
                # No rank tears down its connections while a peer still has work in flight.
                watchdog.beat(cfg.train.steps, "exit")
                dist.barrier()
            except Exception as error:
                explained = watchdog.explain(error)
                if explained is None:
                    raise
                raise explained from error
    finally:
        dist.destroy_process_group()
