"""Train several prepared run dirs one after another in one torchrun world.

    python -m tests.distributed.one_launch NPROC CONFIG_LIST

CONFIG_LIST names one config.yaml per line (run dirs the launcher wrote with
`action=script`), all of one world size. The ranks are forked once, after importing the
trainer (as the CPU agent does), join one process group and run the trainer's own
`pretrain.trainer.train.run` on each config in turn: the tests that compare layouts
(`train_together` in tests/distributed/harness.py) pay the start of a launch once per world
size instead of once per layout (in launches of at most `RANK_RUNS_PER_LAUNCH` runs times
ranks, tests/distributed/harness.py). Each case builds its own mesh (its
process groups are kept to the end: a destroyed group's name is given again to a later one,
whose peers would then find the dead group's addresses in the store), gets a fresh dynamo
cache and its own watchdog; a case that fails ends the launch, and rank 0 names it in
`CONFIG_LIST.failed`.
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path


def run_cases(config_list: Path) -> None:
    """This rank's part of every case in `config_list`, in order."""
    import torch._dynamo
    import torch.distributed as dist

    from pretrain.core.schema import load_config
    from pretrain.trainer.allocator import keep_freed_memory
    from pretrain.trainer.dist import init_distributed
    from pretrain.trainer.faults.timeouts import PhaseTimeouts
    from pretrain.trainer.faults.watchdog import Watchdog
    from pretrain.trainer.train import run

    configs = config_list.read_text().split()
    keep_freed_memory()
    first = load_config(configs[0])
    rank = init_distributed(first.cluster, PhaseTimeouts(first.faults).limit("setup"))
    try:
        for config in configs:
            cfg = load_config(config)
            torch._dynamo.reset()
            try:
                timeouts = PhaseTimeouts(cfg.faults, measure_saves=True)
                with Watchdog(Path(cfg.run.dir), rank.rank, rank.world_size, timeouts) as dog:
                    run(cfg, rank, dog)
                    dist.barrier()
            except BaseException:
                if rank.is_main:
                    failed = config_list.with_suffix(".failed")
                    failed.write_text(f"{config}\n{traceback.format_exc()}")
                raise
    finally:
        dist.destroy_process_group()


def launch(nproc: int, config_list: Path) -> int:
    """torchrun with `nproc` ranks forked from this process, each running `run_cases`."""
    import torch._dynamo  # noqa: F401  (imported once here, not in every forked rank)
    from torch.distributed.run import main as torchrun

    import pretrain.trainer.train  # noqa: F401

    torchrun(
        [
            "--standalone",
            f"--nproc-per-node={nproc}",
            "--start-method",
            "fork",
            "--run-path",
            __file__,
            "--rank-program",
            str(config_list),
        ]
    )
    return 0


if __name__ == "__main__":
    if sys.argv[1] == "--rank-program":
        run_cases(Path(sys.argv[2]))
    else:
        sys.exit(launch(int(sys.argv[1]), Path(sys.argv[2])))
