"""A CPU rank keeps the memory a step frees: a block freed and allocated again is not faulted
in anew, unless the job sets glibc's thresholds itself. Each case runs in a fresh
interpreter (no torch import), so this process's allocator is left as it is."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc")

SCRIPT = """
import resource, sys
from pretrain.trainer.allocator import freed_memory_kept, keep_freed_memory
if sys.argv[1] == "keep":
    keep_freed_memory()
block = bytearray(b"x") * (64 * 2**20)  # written: its pages are faulted in
del block
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(3):  # what each step does with its logits
    block = bytearray(b"x") * (64 * 2**20)
    del block
print(freed_memory_kept(), (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) // 3)
"""
PAGES = 64 * 2**20 // 4096


def faults_per_block(mode: str, **env: str) -> tuple[str, int]:
    """Whether the allocator kept freed memory, and the page faults of one 64 MiB block."""
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, mode],
        capture_output=True, text=True, check=True, env={**os.environ, **env},
    ).stdout.split()  # fmt: skip
    return out[0], int(out[1])


def test_a_freed_block_is_reused_without_faulting_its_pages_in_again() -> None:
    assert faults_per_block("keep") == ("True", pytest.approx(0, abs=PAGES // 10))
    # glibc's own behaviour: a block this large is mapped and unmapped every time.
    kept, faults = faults_per_block("default")
    assert kept == "False" and faults > PAGES // 2


def test_a_job_that_sets_the_malloc_thresholds_keeps_its_own() -> None:
    kept, faults = faults_per_block("keep", MALLOC_MMAP_THRESHOLD_="131072")
    assert kept == "False" and faults > PAGES // 2
