"""`python -m pretrain` is the `pretrain` command."""

import os
import time

# Before the CLI's imports: where the launch-to-first-step breakdown starts.
os.environ.setdefault("PRETRAIN_LAUNCH_T0", str(time.time()))

from pretrain.launcher.entry import pretrain  # first: it takes Ctrl-C while the rest loads

if __name__ == "__main__":
    pretrain()
