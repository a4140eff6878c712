"""Entry point of every rank: `python -m trainer RUN_DIR/config.yaml` (under torchrun)."""

import sys

from trainer.train import main

if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m trainer RUN_DIR/config.yaml")
    main(sys.argv[1])
