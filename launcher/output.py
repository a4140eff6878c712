"""Where the launcher's words go, and how many of them.

stdout carries what a command was asked for, which a pipe or a script may read: the plan
(`action=plan`, a table or `plan.format=json`), `action=suggest`'s table or JSON, the job
script's path (`action=script`), a submitted SLURM job's id, `pretrain status`, the
report's PNG path, the dashboard's URL. Everything the launcher says along the way goes
through `logging` to stderr, at a level:

- debug (shown with `-v`/`--verbose`): the command line handed to Hydra, the commands the
  launcher runs;
- info (the default): what was adopted, the plan before a run, the run dir and its files,
  the sweep's summary;
- warning and error (always shown, even with `-q`/`--quiet`).

A user error still ends in the entry point's one error boundary (core/inputs/boundary.py).
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from typing import TextIO

from pretrain.core.problems import Problem, RecipeError

QUIET_FLAGS = ("-q", "--quiet")
VERBOSE_FLAGS = ("-v", "--verbose")
LOGGER_NAME = "pretrain.launcher"
"""Every launcher module logs to a child of this logger (`get_logger(__name__)`)."""
PREFIXES = {logging.DEBUG: "debug: ", logging.WARNING: "warning: "}
"""What starts a record's line at each level; info and error lines are the message alone
(an error's message names the command or the field itself)."""


class _Prefixed(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return PREFIXES.get(record.levelno, "") + super().format(record)


class _CurrentStderr(logging.StreamHandler):
    """Writes to whatever sys.stderr is when a record is emitted, not when the handler was
    made: a caller that redirects stderr (contextlib.redirect_stderr) gets the records."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, _value: TextIO) -> None:
        """The stream is always the current sys.stderr."""


def get_logger(name: str) -> logging.Logger:
    """The logger of launcher module `name` (its `__name__`), its records printed as the
    module doc says."""
    _launcher_logger()
    return logging.getLogger(name)


def _launcher_logger() -> logging.Logger:
    logger = logging.getLogger(LOGGER_NAME)
    if not any(isinstance(h, _CurrentStderr) for h in logger.handlers):
        handler = _CurrentStderr()
        handler.setFormatter(_Prefixed("%(message)s"))
        logger.addHandler(handler)
        logger.propagate = False  # a host application's root handlers would say it twice
        logger.setLevel(logging.INFO)
    return logger


def set_verbosity(argv: list[str]) -> list[str]:
    """`argv` without -q/--quiet and -v/--verbose, the launcher's log level set from them
    (warnings with -q, debug with -v, info without either). RecipeError for both."""
    quiet = [a for a in argv if a in QUIET_FLAGS]
    verbose = [a for a in argv if a in VERBOSE_FLAGS]
    if quiet and verbose:
        given = f"{quiet[0]} {verbose[0]}"
        reason = f"{quiet[0]} shows warnings only and {verbose[0]} adds debug lines"
        raise RecipeError([Problem("verbosity", given, reason, "give one of them")])
    level = logging.WARNING if quiet else logging.DEBUG if verbose else logging.INFO
    _launcher_logger().setLevel(level)
    return [a for a in argv if a not in QUIET_FLAGS + VERBOSE_FLAGS]


@contextlib.contextmanager
def levels_of_one_command() -> Iterator[None]:
    """Puts the default level (info) back when the command inside ends: -q or -v belongs to
    that command, not to a later one run in the same process."""
    try:
        yield
    finally:
        _launcher_logger().setLevel(logging.INFO)


def info_stream() -> TextIO:
    """The stream the launcher's info lines go to (what a table logged is rendered for)."""
    return sys.stderr
