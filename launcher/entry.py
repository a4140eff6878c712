"""The console scripts, each its command inside the error boundary from the first import
on: a Ctrl-C while the command's modules still load ends as any other (one line, exit
130), and no traceback reaches the console. Nothing is imported here but the boundary."""

from __future__ import annotations

import os
import signal
import sys


def _interrupted_while_loading(signum: int, frame: object) -> None:
    """Ctrl-C before the boundary runs (its modules still load): one line, exit 130."""
    command = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "pretrain"
    command = "pretrain" if command in ("__main__.py", "-c") else command
    os.write(2, f"\n{command}: interrupted (Ctrl-C); stopped\n".encode())
    os._exit(130)


# First, before any other import: run_command puts Python's own handler back.
if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    signal.signal(signal.SIGINT, _interrupted_while_loading)

import importlib  # noqa: E402

from pretrain.core.inputs.boundary import run_command  # noqa: E402


def _main_of(module: str, function: str = "main") -> None:
    getattr(importlib.import_module(module), function)()


def pretrain() -> None:
    """`pretrain` (and `pretrain status`)."""
    run_command("pretrain", lambda: _main_of("pretrain.launcher.cli"))


def report() -> None:
    """`pretrain-report`."""
    run_command("pretrain-report", lambda: _main_of("pretrain.launcher.report"))


def dashboard() -> None:
    """`pretrain-dashboard`."""
    run_command("pretrain-dashboard", lambda: _main_of("pretrain.launcher.dashboard"))


def export() -> None:
    """`pretrain-export`."""
    run_command("pretrain-export", lambda: _main_of("pretrain.trainer.checkpoint.export", "entry"))
