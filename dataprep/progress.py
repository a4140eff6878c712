"""Progress of a preparation: documents, tokens, MB/s, tokens/s and the ETA.

On a terminal one line is redrawn in place twice a second; elsewhere (a SLURM log, a rank's
logger) a plain line is written every `plain_every_s()` seconds, and always at the end.
Waits and loads show theirs the same way (`dataprep/waiting.py`).

Not `rich.progress`: its live display is for a terminal, and most preparations write to a
SLURM log or a rank's logger, where what is needed is a plain line at a fixed interval (and
the same text published to the processes waiting on the lock).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable

from pretrain.core.run.durations import format_duration

PLAIN_EVERY_S = 15.0
"""Seconds between plain progress lines, unless PRETRAIN_PROGRESS_EVERY_S says otherwise."""
PLAIN_EVERY_ENV = "PRETRAIN_PROGRESS_EVERY_S"
TTY_EVERY_S = 0.5
PUBLISH_EVERY_S = 1.0
"""Seconds between the progress notes a preparation leaves for the processes waiting on it."""


def plain_every_s() -> float:
    """Seconds between plain progress lines: PRETRAIN_PROGRESS_EVERY_S, else PLAIN_EVERY_S."""
    try:
        return max(0.1, float(os.environ.get(PLAIN_EVERY_ENV, PLAIN_EVERY_S)))
    except ValueError:
        return PLAIN_EVERY_S


def show_line(line: str, tty: bool, report: Callable[[str], None], last: bool = False) -> None:
    """Redraw `line` in place on a terminal (ending it when `last`), else hand it to
    `report` as a plain line."""
    if tty:
        sys.stdout.write("\r" + line + "\x1b[K" + ("\n" if last else ""))
        sys.stdout.flush()
    else:
        report(line)


def human(n: float) -> str:
    """1234567 -> '1.23M'."""
    for unit, size in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:.0f}"


class Progress:
    """Counts what the workers report and says how far along they are."""

    def __init__(
        self,
        label: str,
        units: int,
        total_bytes: int,
        goals: tuple[int, int],
        report: Callable[[str], None] | None = None,
        tty: bool | None = None,
        publish: Callable[[float | None, str], None] | None = None,
    ) -> None:
        """`total_bytes` of input (0: unknown) and the goals (max_tokens, max_bytes; 0: none)
        give the ETA; `report` takes finished lines (default: stdout); `publish` takes the
        fraction done and the line about once a second (for the processes waiting on it)."""
        self.label = label
        self.units = units
        self.total_bytes = total_bytes
        self.token_goal, self.byte_goal = goals
        self.tty = sys.stdout.isatty() if tty is None and report is None else bool(tty)
        self.report = report or (lambda line: print(line, flush=True))
        self.publish = publish
        self.start = time.perf_counter()
        self.last = self.published = self.start
        self.units_done = self.documents = self.tokens = self.text_bytes = self.input_bytes = 0
        self._before = (0, 0, 0)

    def resumed(self, units: int, input_bytes: int, tokens: int, text_bytes: int) -> None:
        """Work a previous, stopped run finished: done, but not this run's rate."""
        self.units_done, self.input_bytes = units, input_bytes
        self._before = (input_bytes, tokens, text_bytes)

    def add(self, documents: int, tokens: int, text_bytes: int) -> None:
        """Documents, tokens and bytes of text just tokenized."""
        self.documents += documents
        self.tokens += tokens
        self.text_bytes += text_bytes

    def unit_done(self, input_bytes: int) -> None:
        """A unit finished (its input bytes count towards the ETA)."""
        self.units_done += 1
        self.input_bytes += input_bytes

    def fraction(self) -> float | None:
        """How much of this run's work is done, None when it cannot be told."""
        before_input, before_tokens, before_text = self._before
        parts = []
        if self.token_goal > before_tokens:
            parts.append(self.tokens / (self.token_goal - before_tokens))
        if self.byte_goal > before_text:
            parts.append(self.text_bytes / (self.byte_goal - before_text))
        if self.total_bytes > before_input:
            parts.append((self.input_bytes - before_input) / (self.total_bytes - before_input))
        return min(1.0, max(parts)) if parts else None

    def line(self) -> str:
        """The progress line as it stands."""
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        done = self.fraction()
        share = f"{100 * done:.0f}%, " if done is not None else ""
        parts = [
            f"prepare {self.label}: {share}{self.units_done} of {self.units} units",
            f"{self.documents:,} docs",
            f"{human(self.tokens)} tokens",
            f"{self.text_bytes / 1e6 / elapsed:.2f} MB/s",
            f"{human(self.tokens / elapsed)} tok/s",
        ]
        if done is not None and 0 < done < 1:
            parts.append(f"ETA {format_duration(elapsed * (1 - done) / done)}")
        parts.append(f"{format_duration(elapsed)} elapsed")
        return ", ".join(parts)

    def tick(self, force: bool = False) -> None:
        """Show the line if it is time to (or `force`)."""
        now = time.perf_counter()
        if self.publish is not None and (force or now - self.published >= PUBLISH_EVERY_S):
            self.published = now
            self.publish(self.fraction(), self.line())
        if not force and now - self.last < (TTY_EVERY_S if self.tty else plain_every_s()):
            return
        self.last = now
        show_line(self.line(), self.tty, self.report)

    def finish(self) -> None:
        """The final line (ending the redrawn one on a terminal)."""
        self.tick(force=True)
        if self.tty:
            sys.stdout.write("\n")
            sys.stdout.flush()
