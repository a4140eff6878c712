"""The error boundary of every entry point: how a command ends, whatever happened.

- a user error (a RecipeError, a ReadError, a file the system refuses, an unreachable
  network): one line, exit 2;
- Ctrl-C: one line, exit 130;
- anything else is a bug: one line saying what failed, where its traceback was saved and
  how to report it, exit 1.

No traceback reaches the console: every entry point runs its body through `run_command`.
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from pretrain.core.inputs.reading import ReadError
from pretrain.core.problems import RecipeError

TRACEBACK_DIR = "pretrain-tracebacks"
"""Folder under the system's temporary dir where unexpected errors' tracebacks are saved."""
REPORT_HOW = "report it with that file (see CONTRIBUTING.md)"


def save_traceback(command: str, error: BaseException) -> Path | None:
    """Write `error`'s traceback to a new file of its own; its path, None if it cannot be
    written (a read-only or full temporary dir)."""
    folder = Path(tempfile.gettempdir()) / TRACEBACK_DIR
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = folder / f"{command}-{stamp}-{os.getpid()}.txt"
    try:
        folder.mkdir(mode=0o700, exist_ok=True)
        lines = traceback.format_exception(type(error), error, error.__traceback__)
        path.write_text(f"{command} {' '.join(sys.argv[1:])}\n\n{''.join(lines)}")
    except OSError:
        return None
    return path


def unexpected_line(command: str, error: BaseException, saved: Path | None) -> str:
    """The one line an unexpected error gets."""
    what = str(error).splitlines()[0][:200] if str(error) else ""
    where = f"its traceback is in {saved}" if saved else "its traceback could not be saved"
    return (
        f"{command}: unexpected error, a bug: {type(error).__name__}"
        f"{': ' + what if what else ''}; {where}; {REPORT_HOW}"
    )


def os_error_line(command: str, error: OSError) -> str:
    """One line for a file or folder the system refused (permission, missing, full disk)."""
    name = error.filename if error.filename is not None else "a file"
    return f"{command}: {name}: {error.strerror or error}; check the path and its permissions"


def run_command(
    command: str,
    body: Callable[[], int | None],
    user_errors: tuple[type[Exception], ...] = (),
) -> NoReturn:
    """Run an entry point's `body` and exit with its code (None is 0), or as the module doc
    says when it raises. `user_errors` are the command's own error types, shown as they are
    and ending in exit 2."""
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C: KeyboardInterrupt
    try:
        code = body()
    except SystemExit:
        raise
    except KeyboardInterrupt:
        print(f"\n{command}: interrupted (Ctrl-C); stopped", file=sys.stderr)
        raise SystemExit(130) from None
    except (ReadError, RecipeError, *user_errors) as err:  # type: ignore[misc]
        print(f"{command}: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    except (ConnectionError, TimeoutError) as err:  # the network, not a bug
        print(f"{command}: {err}; check the network (or use a local copy)", file=sys.stderr)
        raise SystemExit(2) from None
    except OSError as err:
        if err.filename is None:
            print(unexpected_line(command, err, save_traceback(command, err)), file=sys.stderr)
            raise SystemExit(1) from None
        print(os_error_line(command, err), file=sys.stderr)
        raise SystemExit(2) from None
    except Exception as err:
        print(unexpected_line(command, err, save_traceback(command, err)), file=sys.stderr)
        raise SystemExit(1) from None
    raise SystemExit(code or 0)
