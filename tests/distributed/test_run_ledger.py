"""The ledger a real run leaves (the launcher's record, then the job's), and `pretrain diff`
of two real runs: the one-process reference and the same run with its sums reordered, which
differ in the micro-batch (and in the task and monitors the reference also runs, which do
not change what is trained) and train the same curve. Both runs are the session's own references,
so this launches nothing of its own."""

from __future__ import annotations

import json
import socket
from pathlib import Path

from pretrain.core.run.ledger import read_ledger
from tests.distributed.harness import FP32_TOLERANCE
from tests.helpers import pretrain_in_process


def test_a_trained_run_dir_holds_the_launch_and_the_job_and_diffs_against_its_twin(
    harness_reference_dir: Path,
    reordered_reference_dir: Path,
    monitored_overrides: list[str],
    tmp_path: Path,
) -> None:
    for run_dir in (harness_reference_dir, reordered_reference_dir):
        records, skipped = read_ledger(run_dir) or ([], -1)
        assert skipped == 0 and [r["kind"] for r in records] == ["launch", "job"]
        launch, job = records
        assert job["hosts"] == [socket.gethostname()] and job["start_step"] == 0
        assert job["world_size"] == 1 and job["code"] == launch["code"]
        assert job["packages"] == launch["packages"]

    code, out, err = pretrain_in_process(
        "diff", str(harness_reference_dir), str(reordered_reference_dir), "--format", "json",
        "--rtol", str(FP32_TOLERANCE), cwd=tmp_path,
    )  # fmt: skip
    assert code == 0, err
    found = json.loads(out)
    monitored = {override.split("=")[0] for override in monitored_overrides}
    differing = {entry["field"]: (entry["a"], entry["b"]) for entry in found["config"]}
    assert differing.pop("train.micro_batch") == (2, 1)
    assert set(differing) == monitored
    assert found["environment"] == [] and found["code"]["a"] == found["code"]["b"]
    assert found["hosts"] == {"a": [socket.gethostname()], "b": [socket.gethostname()]}
    assert {"field": "grad_accum", "a": 4, "b": 8} in found["plan"]
    curves = found["curves"]
    assert curves["parting_step"] is None and curves["common_steps"] == curves["steps_a"] > 1
