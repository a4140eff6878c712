"""A local run stopped by SIGTERM ends like a preempted one: every rank finishes its step, the
checkpoint of that step is written, the preempted marker is left and `pretrain` exits 0
without a traceback. The same run has a slow rank (PRETRAIN_FAULT_SLOW_RANK), which the
straggler detector names with its host at every logged step, and no other (a run without a
slow rank naming none is checked on the 8-rank runs of test_three_d_parity.py).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.distributed.harness import BASE_OVERRIDES

pytestmark = pytest.mark.distributed

SLOW_RANK, SLOW_S = 1, 0.5
"""Rank 1 computes 0.5 s longer every step (a step of the harness model computes ~0.05 s)."""


def test_sigterm_saves_and_exits_0_and_the_slow_rank_is_named(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    command = [
        sys.executable, "-m", "pretrain", "--config-name", "tiny", *BASE_OVERRIDES,
        "train.steps=1000", "logging.log_every=2", "checkpoint.every=0",
        "cluster.gpus_per_node=2", f"run.dir={run_dir}",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PRETRAIN_FAULT_SLOW_RANK": f"1:{SLOW_S}"}
    launcher = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        metrics = run_dir / "metrics.jsonl"
        deadline = time.monotonic() + 240
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
            assert launcher.poll() is None, "training stopped before the signal"
            assert time.monotonic() < deadline, "no second logged step in 240 s"
            time.sleep(0.2)
        launcher.send_signal(signal.SIGTERM)
        output, _ = launcher.communicate(timeout=180)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    (tmp_path / "run.log").write_text(output)

    assert launcher.returncode == 0, output[-3000:]
    stopped = re.search(r"stopped by SIGTERM after step (\d+); saved", output)
    assert stopped, output[-3000:]
    step = int(stopped[1])
    assert (run_dir / "preempted").read_text() == f"{step}\n"
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == [f"step_{step:08d}"]
    assert "[agent] stopped by SIGTERM; the ranks saved" in output
    assert "Traceback" not in output

    named = re.findall(r"rank (\d+) \(host \S+\) is a straggler: ([\d.]+) s of compute", output)
    assert len(named) >= 2  # every logged window
    assert {int(rank) for rank, _ in named} == {SLOW_RANK}
    assert all(float(seconds) >= SLOW_S for _, seconds in named)
