"""A SLURM job that loses nodes goes on with the nodes left (cluster.min_nodes): the
launcher chooses a layout for each smaller node count at submission, and the job script
runs the next step on the nodes its allocation keeps, with that layout's config. The script
runs here against stand-ins for srun and scontrol; tests/slurm/test_multinode.py loses a
node of the real test cluster."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from pretrain.core.problems import RecipeError
from pretrain.core.run.rundir import shrunk_config
from pretrain.core.schema import RecipeConfig, load_config
from pretrain.launcher.job.run_dir import write_run_dir
from pretrain.launcher.plan.shrink import shrunk_recipes
from pretrain.launcher.validate.recipe import validate
from tests.helpers import problems

# srun fails the first time (a node was lost: SLURM then lists only node1 in the job), and
# succeeds after; every call is recorded with the config the ranks would read.
STUB = """#!/bin/bash
echo "$(basename "$0") $* CONFIG=${CONFIG:-}" >>"$CALLS"
case "$(basename "$0") $1 $2" in
    "scontrol show hostnames")
        case "$3" in "node[1-2]") printf 'node1\\nnode2\\n' ;; *) echo "$3" ;; esac ;;
    "scontrol show node") echo "NodeName=$3 NodeAddr=10.0.0.7 State=IDLE" ;;
    "scontrol show job")
        if [ -e "$CALLS.failed" ]; then kept=node1; else kept="node[1-2]"; fi
        echo "   NodeList=$kept" ;;
    srun*)
        if [ -e "$CALLS.failed" ]; then exit 0; fi
        touch "$CALLS.failed"; exit "$FIRST_STATUS" ;;
esac
"""


def cpu_job(min_nodes: int) -> RecipeConfig:
    """Two CPU nodes of two ranks each, on SLURM, the tiny default model."""
    cfg = RecipeConfig(name="shrinks")
    cfg.cluster.backend, cfg.cluster.device = "slurm", "cpu"
    cfg.cluster.nodes, cfg.cluster.gpus_per_node = 2, 2
    cfg.cluster.min_nodes = min_nodes
    cfg.train.global_batch = 16
    return cfg


def run_script(tmp_path: Path, cfg: RecipeConfig, first_status: int) -> tuple[int, list[str]]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("srun", "scontrol"):
        (bin_dir / name).write_text(STUB)
        (bin_dir / name).chmod(0o755)
    files = write_run_dir(cfg, tmp_path / "run", "name: shrinks\n")
    calls = tmp_path / "calls"
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "CALLS": str(calls),
        "FIRST_STATUS": str(first_status),
        "SLURM_JOB_ID": "42",
        "SLURM_JOB_NODELIST": "node[1-2]",
        "SLURM_JOB_NUM_NODES": "2",
    }
    result = subprocess.run(["bash", str(files.script_path)], env=env, capture_output=True)
    return result.returncode, calls.read_text().splitlines()


def test_the_launcher_writes_a_validated_config_for_each_node_count_the_job_may_shrink_to(
    tmp_path: Path,
) -> None:
    cfg = cpu_job(min_nodes=1)
    [(nodes, (_, how))] = shrunk_recipes(cfg).items()
    assert nodes == 1 and how.startswith("the same degrees")
    write_run_dir(cfg, tmp_path / "run", "name: shrinks\n")
    written = load_config(tmp_path / "run" / shrunk_config(1))
    assert (written.cluster.nodes, written.parallel.dp_shard) == (1, -1)
    validate(written, for_launch=True)
    # The global batch is kept: each of the 2 ranks left accumulates twice as many.
    assert written.train.global_batch == cfg.train.global_batch
    assert not (tmp_path / "run" / shrunk_config(2)).exists()


def test_a_job_that_loses_a_node_goes_on_with_the_nodes_left_and_their_layout(
    tmp_path: Path,
) -> None:
    code, calls = run_script(tmp_path, cpu_job(min_nodes=1), first_status=1)
    assert code == 0
    first, second = [call for call in calls if call.startswith("srun ")]
    assert "--nodes=2 --ntasks=2 --nodelist=node[1-2]" in first
    assert first.endswith(f"CONFIG={tmp_path / 'run' / 'config.yaml'}")
    assert "--nodes=1 --ntasks=1 --nodelist=node1" in second and "--overlap" in second
    assert second.endswith(f"CONFIG={tmp_path / 'run' / shrunk_config(1)}")


@pytest.mark.parametrize("min_nodes", [0, 2])
def test_a_job_that_may_not_shrink_fails_with_the_trainers_exit_code(
    tmp_path: Path, min_nodes: int
) -> None:
    code, calls = run_script(tmp_path, cpu_job(min_nodes=min_nodes), first_status=3)
    assert code == 3
    assert len([call for call in calls if call.startswith("srun ")]) == 1


def test_a_node_count_no_layout_fits_is_refused_naming_min_nodes() -> None:
    cfg = cpu_job(min_nodes=1)
    cfg.parallel.tp = 4  # 4-way tensor parallelism needs both nodes' ranks
    with pytest.raises(RecipeError) as error:
        shrunk_recipes(cfg)
    [problem] = error.value.problems
    assert problem.field == "cluster.min_nodes" and "on 1 node(s) of 2" in problem.reason
    assert "raise cluster.min_nodes above 1" in problem.fix


@pytest.mark.parametrize(
    ("cluster", "reason"),
    [
        ({"min_nodes": 3, "nodes": 2}, "must be between 1 and cluster.nodes=2"),
        ({"min_nodes": -1}, "must be between 1"),
        ({"min_nodes": 1, "backend": "local"}, "a local run has one node"),
    ],
)
def test_min_nodes_outside_the_job_or_on_a_local_run_is_refused(cluster: dict, reason: str):
    cfg = cpu_job(min_nodes=1)
    for key, value in cluster.items():
        setattr(cfg.cluster, key, value)
    found = [p for p in problems(cfg) if p.field == "cluster.min_nodes"]
    assert len(found) == 1 and reason in found[0].reason


def test_status_tells_where_each_job_ran_and_from_which_step_the_layout_changed(
    tmp_path: Path,
) -> None:
    from pretrain.core.run.ledger import append_record, job_record
    from pretrain.launcher.job.status import hosts_line

    for nodelist, world, step in (("node[1-2]", 2, 0), ("node[1-2]", 2, 2), ("node1", 1, 4)):
        environ = {"SLURM_JOB_NODELIST": nodelist, "SLURM_JOB_ID": "42"}
        append_record(tmp_path, job_record(environ, world, step))
    assert hosts_line(tmp_path) == "node[1-2] (world 2); from step 4: node1 (world 1)"
    assert hosts_line(tmp_path / "none") == "-"
