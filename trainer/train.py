"""The per-rank training program: set up from the frozen config, then step and log.

Everything is built before the loop (`trainer.setup`); the loop only calls components: the
step of the layout, the fault guard and injector, the checkpointer (which decides when a
save is due), the metrics window (timing and the metrics dict) and the metrics sinks.
"""

from __future__ import annotations

import torch.distributed as dist

from pretrain_core.schema import RecipeConfig, load_config
from trainer.dist import RankInfo, init_distributed
from trainer.faults import mark_preempted
from trainer.log import get_logger
from trainer.setup import Run, setup


def train(run: Run) -> None:
    """Step `run` from its start to `train.steps`, logging and checkpointing on the way."""
    total = run.cfg.train.steps
    with run.metrics as metrics:
        for step in range(run.start + 1, total + 1):
            run.faults.begin_step(step)
            micro_batches = run.window.wait_for_data(run.loader.next_step)
            result = run.stepper.step(micro_batches)
            run.guard.record(step, result.bad)
            run.faults.after_step()
            run.window.step_done(result)
            run.checkpointer.after_step(step, run.state, run.loader, result.stop)
            if run.window.due(step, last=step == total, stop=result.stop):
                metrics.log(step, run.window.collect(step))
            if result.stop:
                _stop_after_save(run, step)
                return
        run.checkpointer.finish(total, run.state, run.loader)


def _stop_after_save(run: Run, step: int) -> None:
    """The job was asked to stop: the checkpoint of `step` is written; leave the marker the
    job script requeues on."""
    run.checkpointer.wait()
    if run.rank.is_main:
        mark_preempted(run.run_dir, step)
    get_logger().info("stopped by a signal after step %d; saved", step)


def run(cfg: RecipeConfig, rank: RankInfo) -> None:
    """Train `cfg` on this rank until `train.steps`."""
    train(setup(cfg, rank))


def main(config_path: str) -> None:
    """Run one rank of the job described by the run dir's config.yaml."""
    cfg = load_config(config_path)
    rank = init_distributed(cfg.cluster, cfg.faults.collective_timeout_s)
    try:
        run(cfg, rank)
        # No rank tears down its connections while a peer still has work in flight.
        dist.barrier()
    finally:
        dist.destroy_process_group()
