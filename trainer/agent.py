"""The per-node agent: `python3 -m pretrain.trainer.agent TORCHRUN_ARGS... -m pretrain.trainer
CONFIG`.

It is torchrun, with two differences that matter for stopping and restarting a job:

- A stop signal after which the ranks saved is a clean exit. On SIGTERM torchrun forwards the
  signal to its ranks, waits for them (`--shutdown-timeout`), then raises, which prints a
  traceback and exits 1, so a job script cannot tell a preempted job from a crashed one. The
  ranks answer SIGTERM as they answer SIGUSR1: finish the step, save, leave the preempted
  marker in the run dir. So when torchrun stops on a signal and the marker is there, this
  exits 0 without a traceback; otherwise 128 + the signal's number, as a shell reports it.
- On CPU the ranks are forked from this agent once it has imported the trainer (torchrun's
  `--start-method fork --run-path`), instead of each starting an interpreter that imports
  torch and the trainer again: about 3 s of CPU per rank, which on a small machine running
  eight ranks is most of the start. On CUDA the ranks are started afresh as usual: a CUDA
  driver touched before a fork does not work in the child. A forked rank's exit is logged
  in one line, as a fresh rank's is, without the traceback of torchrun's own join.
- Every rendezvous round gets its own store, hosted by the new rank 0, so the ranks of a
  group that torchrun restarted never read the keys of the group that died, on every node
  alike (torchrun's shared store would need a per-attempt prefix, and the attempt counters
  of the nodes' agents need not agree: a node whose ranks were healthy restarts them
  without counting an attempt).
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from pretrain.core.run.rundir import PREEMPTED_MARKER
from pretrain.core.schema import load_config


def stopped_after_saving(argv: list[str]) -> bool:
    """Whether the run whose config is the last argument left the preempted marker."""
    return bool(argv) and (Path(argv[-1]).parent / PREEMPTED_MARKER).is_file()


TRAINER_MODULE = ["-m", "pretrain.trainer"]
FORK_ENV = "PRETRAIN_FORK_RANKS"
"""Set to 0 to start CPU ranks as fresh interpreters, as on CUDA."""


ELASTIC_PROCESS_LOGGER = "torch.distributed.elastic.multiprocessing.api"
"""torchrun's logger that reports a rank's exit."""


class ForkedExitWithoutTraceback(logging.Filter):
    """Drops the traceback torchrun logs with a forked rank's exit.

    A forked rank's death reaches the agent as an exception of its own join
    (`ProcessExitedException`), which torchrun logs with that exception's traceback: agent
    code, nothing of the rank. A fresh rank's exit is logged as one line; so is this one.
    The rank's own traceback is in its log either way.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if record.getMessage().startswith("failed (exitcode"):
            record.exc_info, record.exc_text = None, None
        return True


def forked_ranks(argv: list[str]) -> list[str]:
    """`argv` (ending in `-m pretrain.trainer CONFIG`) with the ranks forked from this process when
    the job runs on CPU, after importing what every rank imports; `argv` itself otherwise."""
    if os.environ.get(FORK_ENV, "1") == "0":
        return argv
    if argv[-3:-1] != TRAINER_MODULE or load_config(argv[-1]).cluster.device != "cpu":
        return argv
    import torch._dynamo  # noqa: F401  (building on the meta device imports it: 0.5 s a rank)

    import pretrain.trainer.faults.failure_report
    import pretrain.trainer.train

    logging.getLogger(ELASTIC_PROCESS_LOGGER).addFilter(ForkedExitWithoutTraceback())
    main_file = Path(pretrain.trainer.__file__).with_name("__main__.py")
    return [*argv[:-3], "--start-method", "fork", "--run-path", str(main_file), argv[-1]]


def main(argv: list[str]) -> int:
    """Run torchrun with `argv`; its exit code, 0 for a stop after which the ranks saved."""
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main as torchrun

    try:
        torchrun(forked_ranks(argv))
    except SignalException as stop:
        # torchrun has already forwarded the signal and waited for its ranks to exit.
        if stopped_after_saving(argv):
            print(f"[agent] stopped by {stop.sigval.name}; the ranks saved", flush=True)
            return 0
        return 128 + int(stop.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
