"""Entry point of every rank: `python -m trainer RUN_DIR/config.yaml` (under torchrun).

The rank first ties its life to torchrun's (torchrun starts it in a session of its own, so
nothing else would stop it if torchrun and the launcher were killed), then runs; any
failure ends it the one reported way (`trainer/failure_report.py`).
"""

import os
import sys
import time

# Before any heavy import: the start of this rank's process (trainer/startup.py).
os.environ.setdefault("PRETRAIN_RANK_T0", str(time.time()))

from pretrain_core.lifeline import die_with_parent

if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m trainer RUN_DIR/config.yaml")
    die_with_parent()
    from trainer.failure_report import reported_failures
    from trainer.train import main

    with reported_failures(sys.argv[1]):
        main(sys.argv[1])
    # Everything is written and the process group is gone. Skipping interpreter teardown
    # avoids gloo worker threads releasing tensors while Python is finalizing, which can
    # abort a rank that has already finished cleanly.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
