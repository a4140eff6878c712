"""Entry point of every rank: `python -m trainer RUN_DIR/config.yaml` (under torchrun)."""

import os
import sys

from trainer.train import main

if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m trainer RUN_DIR/config.yaml")
    main(sys.argv[1])
    # Everything is written and the process group is gone. Skipping interpreter teardown
    # avoids gloo worker threads releasing tensors while Python is finalizing, which can
    # abort a rank that has already finished cleanly.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
