"""Host memory of a CPU rank: freed memory kept for the next step instead of handed back.

glibc's malloc serves every allocation above its mmap threshold (128 KiB, adjusted with use
up to 32 MiB) with a mapping of its own and unmaps it when it is freed. A training step
frees and allocates again the same activations, logits and gradients every step, so on CPU
each step faulted in and zeroed those pages anew: about 70,000 minor page faults a step on
the d=256, vocab 8192, 8 x 256-token workload of bench/trainer_table.py, a tenth of the
step's CPU time spent in the kernel. Raising the mmap and trim thresholds keeps freed
memory in the heap, where the next step's allocations reuse it.

A job that sets MALLOC_MMAP_THRESHOLD_ or MALLOC_TRIM_THRESHOLD_ (cluster.env) keeps its own
settings; elsewhere than glibc nothing changes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
"""mallopt's parameters (glibc's malloc.h)."""
KEEP_BYTES = 2**31 - 1
"""Both thresholds: the largest value mallopt takes (an int)."""
ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")

_kept = False


def keep_freed_memory() -> bool:
    """Make malloc keep freed memory for reuse (see the module); whether it now does."""
    global _kept
    if _kept or any(name in os.environ for name in ENV):
        return _kept
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    _kept = all(mallopt(option, KEEP_BYTES) == 1 for option in (M_MMAP_THRESHOLD, M_TRIM_THRESHOLD))
    return _kept


def freed_memory_kept() -> bool:
    """Whether `keep_freed_memory` took effect in this process."""
    return _kept
