"""Progress of a wait or a load: what it is for, how long it has taken, and, where that can
be measured, how far along it is and when it will end.

    data: waiting for the preparation of 'corpus' (held by pid 12 on host n1 since ...;
          prepare corpus: 40%, ...): 40%, ETA 1m10s, 35s elapsed
    checkpoint: loaded step 40 (12.3 MB) in 2.1s

The block inside `with Wait(...)` may block in one call (a lock, a DCP load): a thread
shows the line meanwhile. On a terminal it is redrawn in place; elsewhere (a SLURM log, a
rank's logger) a plain line is written every `plain_every_s()` seconds
(PRETRAIN_PROGRESS_EVERY_S), and a final line with the duration always.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from types import TracebackType

from pretrain.core.run.durations import format_duration
from pretrain.dataprep.progress import TTY_EVERY_S, plain_every_s, show_line

Report = Callable[[str], None]


class Wait:
    """Shows one wait or load while its block runs, then its duration."""

    def __init__(
        self,
        what: str,
        report: Report | None = None,
        *,
        tty: bool | None = None,
        detail: Callable[[], str] | None = None,
        fraction: Callable[[], float | None] | None = None,
        announce: bool = True,
    ) -> None:
        """`what` names the wait ('data: waiting for ...'); `detail` says more as it goes
        (the holder of a lock), `fraction` how much is done (None: unknown); `announce`
        writes the first plain line at once rather than after the interval. `report` takes
        plain lines (default: stdout); `tty` redraws one line instead (default: when there
        is no `report` and stdout is a terminal)."""
        self.what = what
        self.report = report or (lambda line: print(line, flush=True))
        self.tty = sys.stdout.isatty() if tty is None and report is None else bool(tty)
        self.detail = detail
        self.fraction = fraction
        self.announce = announce
        self.outcome = ""
        """The final line's text, set by the block (default: '<what>: done')."""
        self.start = time.perf_counter()
        self._first: tuple[float, float] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _measured(self) -> tuple[str, float | None]:
        """The detail and the fraction done, each guarded: a display never fails its wait."""
        try:
            detail = self.detail() if self.detail else ""
            done = self.fraction() if self.fraction else None
        except Exception as exc:  # a file read by the thread may vanish meanwhile
            return f" (unknown: {type(exc).__name__})", None
        return (f" ({detail})" if detail else ""), done

    def _eta(self, done: float | None, now: float) -> str:
        """From the pace since the fraction was first seen, so an old start does not count."""
        if done is None:
            return ""
        if self._first is None:
            self._first = (now, done)
        since, first = self._first
        if 0 < done < 1 and done > first and now > since:
            return f"ETA {format_duration((now - since) * (1 - done) / (done - first))}"
        return ""

    def line(self) -> str:
        """The line as it stands."""
        now = time.perf_counter()
        detail, done = self._measured()
        parts = [f"{100 * done:.0f}%"] if done is not None else []
        parts += [eta] if (eta := self._eta(done, now)) else []
        parts.append(f"{format_duration(now - self.start)} elapsed")
        return f"{self.what}{detail}: " + ", ".join(parts)

    def _show(self) -> None:
        show_line(self.line(), self.tty, self.report)

    def _run(self) -> None:
        every = TTY_EVERY_S if self.tty else plain_every_s()
        if self.announce:
            self._show()
        while not self._stop.wait(every):
            self._show()

    def __enter__(self) -> Wait:
        self.start = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="progress", daemon=True)
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        seconds = format_duration(time.perf_counter() - self.start)
        if exc_type is not None:
            final = f"{self.what}: stopped after {seconds} ({exc_type.__name__})"
        else:
            final = f"{self.outcome or self.what + ': done'} in {seconds}"
        show_line(final, self.tty, self.report, last=True)
