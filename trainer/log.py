"""The trainer's console messages: stdlib logging, from rank 0 unless every rank is asked for.

    [trainer] resumed from the checkpoint of step 40          (rank 0, the default)
    [trainer rank 3] step 12: non-finite loss; skipped        (logging.all_ranks=true)

Metrics lines go through `pretrain.trainer.observe.loggers.MetricsLogger`; this is for everything
else the
ranks have to say. Messages go to stdout, which torchrun and SLURM collect.
"""

from __future__ import annotations

import logging
import sys

LOGGER_NAME = "pretrain.trainer"


def get_logger() -> logging.Logger:
    """The trainer's logger (configured by `setup_logging` on each rank)."""
    return logging.getLogger(LOGGER_NAME)


def setup_logging(rank: int, all_ranks: bool = False) -> logging.Logger:
    """Configure the trainer's logger for this rank: rank 0 logs INFO and up, other ranks
    only warnings, unless `all_ranks`, where every rank logs with its rank in the prefix."""
    logger = get_logger()
    logger.handlers.clear()
    handler = logging.StreamHandler(sys.stdout)
    prefix = f"[trainer rank {rank}]" if all_ranks else "[trainer]"
    handler.setFormatter(logging.Formatter(f"{prefix} %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO if all_ranks or rank == 0 else logging.WARNING)
    # The root logger's handlers (W&B, torch) must not print these a second time.
    logger.propagate = False
    return logger
