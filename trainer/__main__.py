"""Entry point of every rank: `python -m pretrain.trainer RUN_DIR/config.yaml` (under torchrun), or
this file run in a process forked from the agent (`trainer/agent.py`, on CPU).

The rank first ties its life to torchrun's (torchrun starts it in a session of its own, so
nothing else would stop it if torchrun and the launcher were killed), then runs; any
failure ends it the one reported way (`trainer/faults/failure_report.py`).
"""

import multiprocessing
import os
import signal
import sys
import time

# Before any heavy import: the start of this rank's process (trainer/observe/startup.py).
os.environ.setdefault("PRETRAIN_RANK_T0", str(time.time()))

from pretrain.core.run.lifeline import die_with_parent

if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m pretrain.trainer RUN_DIR/config.yaml")
    die_with_parent()
    forked = multiprocessing.parent_process() is not None
    if forked:
        # A fork inherits the agent's handlers, which turn a stop signal into an exception,
        # and its buffered stdout (torchrun starts a fresh rank with -u).
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
            signal.signal(sig, signal.SIG_DFL)
        sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    from pretrain.trainer.faults.failure_report import reported_failures
    from pretrain.trainer.train import main

    with reported_failures(sys.argv[1]):
        main(sys.argv[1])
    if forked:
        sys.stdout.flush()
        sys.stderr.flush()
        from pretrain.trainer.faults.step_guard import received_stop_signal

        stopped_by = received_stop_signal()
        if stopped_by == signal.SIGTERM:
            # The agent got it too (from the launcher or SLURM, or it sent it itself): it is
            # closing and waits for this process to exit, not for its result.
            os._exit(128 + stopped_by)
        # From here a stop signal means the agent is closing: end at once.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        # The agent reads this rank's result when it returns (SIGUSR1, which the agent
        # ignores, or a normal end); the fork ends without interpreter teardown anyway.
        sys.exit(0)
    # Everything is written and the process group is gone. Skipping interpreter teardown
    # avoids gloo worker threads releasing tensors while Python is finalizing, which can
    # abort a rank that has already finished cleanly.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
