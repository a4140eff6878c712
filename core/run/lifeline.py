"""Processes that die with their parent: no trainer outlives the launcher that started it.

torchrun starts every rank in a session of its own, so neither a killed process group nor
a closed terminal reaches the ranks. Linux's parent-death signal does: the launcher asks
for it for torchrun, and each rank for itself (its parent being torchrun).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def die_with_parent(sig: int = signal.SIGKILL, libc: ctypes.CDLL | None = None) -> bool:
    """Ask the kernel to send `sig` to this process when its parent exits; then make sure
    the parent did not exit already. False where the kernel has no such request (not Linux).

    `libc` may be loaded beforehand (`_libc()`), for a child between fork and exec.
    """
    parent = os.getppid()
    libc = libc or _libc()
    if libc is None or libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return False
    if os.getppid() != parent:
        # The parent exited before the request took effect: nobody will send the signal.
        os.kill(os.getpid(), sig)
    return True


def child_dies_with_us(sig: int = signal.SIGKILL) -> Callable[[], None]:
    """A `subprocess.Popen(preexec_fn=...)` that ties the child's life to this process."""
    libc = _libc()
    me = os.getpid()

    def preexec() -> None:
        if libc is not None:
            libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != me:
            os._exit(1)

    return preexec
