"""The run dir and its job scripts: torchrun command lines, sbatch directives, quoting."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pretrain.core.schema import RecipeConfig
from pretrain.launcher.job.run_dir import (
    AGENT,
    RDZV_ENDPOINT,
    RDZV_ID,
    JobError,
    local_command,
    render_sbatch,
    torchrun_args,
    write_run_dir,
)
from tests.helpers import wait_until_gone

# Each tries to create the marker file if any shell ever evaluates it instead of quoting it.
INJECTIONS = ["x; touch {m}", "$(touch {m})", "`touch {m}`", "a'b\"c $(touch {m}) %j #"]


def slurm_recipe(**cluster: object) -> RecipeConfig:
    cfg = RecipeConfig()
    cfg.cluster.backend = "slurm"
    for key, value in cluster.items():
        setattr(cfg.cluster, key, value)
    return cfg


def directives(script: str) -> list[str]:
    return [
        line.removeprefix("#SBATCH ") for line in script.splitlines() if line.startswith("#SBATCH ")
    ]


def srun_line_of(script: str) -> str:
    """The job script's one srun command, its continued lines joined."""
    joined = script.replace("\\\n", " ")
    [line] = [line.strip() for line in joined.splitlines() if line.strip().startswith("srun ")]
    return line


def words_bash_passes(command_line: str, env: dict[str, str] | None = None) -> list[str]:
    """The arguments bash hands to the command on this line: its first word is swapped for a
    printf of them, so bash's own expansion is what gets checked."""
    _, rest = command_line.split(" ", 1)
    out = subprocess.run(
        ["bash", "-c", "printf '%s\\0' " + rest],
        env=env, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return out.split("\0")[:-1]


def test_one_node_runs_a_standalone_torchrun_through_the_agent() -> None:
    cfg = RecipeConfig()
    cfg.cluster.gpus_per_node = 2
    args = torchrun_args(cfg, Path("/runs/a/config.yaml"))
    assert args == [
        sys.executable, "-m", "pretrain.trainer.agent", "--standalone", "--nproc-per-node", "2",
        "--shutdown-timeout", str(cfg.cluster.signal_seconds),
        "-m", "pretrain.trainer", "/runs/a/config.yaml",
    ]  # fmt: skip


def test_two_nodes_meet_in_a_c10d_rendezvous_keyed_by_the_job_id() -> None:
    cfg = slurm_recipe(nodes=2, gpus_per_node=4, max_restarts=3)
    args = torchrun_args(cfg, Path("/runs/a/config.yaml"))
    assert args == [
        sys.executable, *AGENT, "--nnodes", "2", "--nproc-per-node", "4", "--max-restarts", "3",
        "--shutdown-timeout", str(cfg.cluster.signal_seconds),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", "$MASTER_ADDR:$MASTER_PORT",
        "--rdzv-id", "$SLURM_JOB_ID",
        "-m", "pretrain.trainer", "/runs/a/config.yaml",
    ]  # fmt: skip
    assert (RDZV_ENDPOINT, RDZV_ID) == ("$MASTER_ADDR:$MASTER_PORT", "$SLURM_JOB_ID")


def test_sbatch_for_a_llama3_70b_cluster_has_exactly_its_directives(tmp_path: Path) -> None:
    cfg = slurm_recipe(nodes=8, gpus_per_node=8, partition="gpu", account="llm", time="48:00:00")
    cfg.name = "llama3_70b"
    c = cfg.cluster
    script = render_sbatch(cfg, tmp_path, tmp_path / "config.yaml")
    log = f'"{tmp_path}/logs/slurm-%j.out"'
    assert directives(script) == [
        f'--job-name="{cfg.name}"',
        f"--nodes={c.nodes}",
        "--ntasks-per-node=1",
        f"--cpus-per-task={c.cpus_per_task}",
        f'--time="{c.time}"',
        f"--output={log}",
        f"--error={log}",
        "--requeue",
        "--open-mode=append",
        f"--signal=USR1@{c.signal_seconds}",
        f"--gpus-per-node={c.gpus_per_node}",
        f'--partition="{c.partition}"',
        f'--account="{c.account}"',
    ]
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)


def test_sbatch_directives_all_come_before_the_first_command(tmp_path: Path) -> None:
    # sbatch stops reading #SBATCH lines at the first command.
    script = render_sbatch(slurm_recipe(qos="high"), tmp_path, tmp_path / "config.yaml")
    lines = script.splitlines()
    first_command = next(i for i, line in enumerate(lines) if line and not line.startswith("#"))
    last_directive = max(i for i, line in enumerate(lines) if line.startswith("#SBATCH"))
    assert last_directive < first_command


def test_cpu_job_requests_no_gpus_and_unset_fields_are_left_out(tmp_path: Path) -> None:
    script = render_sbatch(slurm_recipe(device="cpu"), tmp_path, tmp_path / "config.yaml")
    names = {d.split("=")[0] for d in directives(script)}
    assert names.isdisjoint({"--gpus-per-node", "--partition", "--account", "--qos"})


def test_the_job_ends_with_srun_of_the_agent_in_a_task_that_ignores_sigusr1(
    tmp_path: Path,
) -> None:
    cfg = slurm_recipe(nodes=2, gpus_per_node=4)
    config = tmp_path / "config.yaml"
    srun_line = srun_line_of(render_sbatch(cfg, tmp_path, config))
    step = {**os.environ, "NODES": "2", "NODELIST": "node[1-2]", "STEP_OPTIONS": ""}
    srun = words_bash_passes(srun_line, step)
    assert srun[:7] == [
        "--nodes=2", "--ntasks=2", "--nodelist=node[1-2]", "--ntasks-per-node=1",
        "--kill-on-bad-exit=1", "bash", "-c",
    ]  # fmt: skip
    trap, exec_agent = srun[7].split("; ", 1)
    assert trap == 'trap "" USR1'
    assert exec_agent.startswith(f"exec {shlex.quote(sys.executable)} -m pretrain.trainer.agent ")
    node = {
        **os.environ, "SLURM_JOB_ID": "77", "MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "29500",
        "NODES": "2", "CONFIG": str(config),
    }  # fmt: skip
    expected = torchrun_args(cfg, config)
    expected[expected.index(RDZV_ENDPOINT)] = "10.0.0.7:29500"
    expected[expected.index(RDZV_ID)] = "77"
    assert words_bash_passes(exec_agent, node) == expected


def rendezvous_port(script: str, job_id: str) -> str:
    """MASTER_PORT as the job script's export line sets it in a job of id `job_id`."""
    lines = [line.strip() for line in script.splitlines()]
    [line] = [line for line in lines if line.startswith("export MASTER_PORT=")]
    env = {**os.environ, "SLURM_JOB_ID": job_id}
    command = ["bash", "-c", f'{line}\nprintf %s "$MASTER_PORT"']
    return subprocess.run(command, env=env, capture_output=True, text=True, check=True).stdout


def test_each_job_meets_on_a_port_of_its_own_unless_the_recipe_names_one(
    tmp_path: Path,
) -> None:
    # Jobs sharing a node on one port would share one store and dial each other's ranks.
    script = render_sbatch(slurm_recipe(nodes=2), tmp_path, tmp_path / "config.yaml")
    ports = {job: rendezvous_port(script, job) for job in ("77", "78", "20077")}
    assert ports == {"77": "10077", "78": "10078", "20077": "10077"}
    fixed = render_sbatch(slurm_recipe(master_port=29500), tmp_path, tmp_path / "config.yaml")
    assert rendezvous_port(fixed, "77") == "29500"


@pytest.mark.parametrize("attack", INJECTIONS)
def test_recipe_strings_reach_the_shell_as_literals_and_never_run(
    tmp_path: Path, attack: str
) -> None:
    marker = tmp_path / "owned"
    value = attack.format(m=marker)
    cfg = slurm_recipe(device="cpu", partition=value, account=value, env={"EVIL": value})
    cfg.name = value
    run_dir = tmp_path / value
    files = write_run_dir(cfg, run_dir, "name: x\n")
    script = files.script_path.read_text()

    # The environment part runs for real (in a job: SLURM sets the job id); every value
    # arrives byte for byte.
    exports = "\n".join(line for line in script.splitlines() if line.startswith("export "))
    env = subprocess.run(
        ["bash", "-c", "set -euo pipefail\n" + exports + "\nprintf '%s' \"$EVIL\""],
        env={**os.environ, "SLURM_JOB_ID": "77"}, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert env == value
    # The config's path reaches the job's CONFIG byte for byte, and the node command
    # expands to torchrun's argv with it.
    [assignment] = [line for line in script.splitlines() if line.startswith("CONFIG=")]
    config = subprocess.run(
        ["bash", "-c", f'{assignment}\nprintf %s "$CONFIG"'], capture_output=True, text=True,
        check=True,
    ).stdout  # fmt: skip
    assert config == str(files.config_path)
    step = {**os.environ, "NODES": "1", "NODELIST": "node1", "STEP_OPTIONS": ""}
    srun = words_bash_passes(srun_line_of(script), step)
    torchrun = words_bash_passes(srun[7].split("; ", 1)[1], {**step, "CONFIG": config})
    assert torchrun == torchrun_args(cfg, files.config_path)
    # sbatch's quoting keeps the value whole (its parser reads "..." with \" escapes).
    assert f'--partition="{value.replace(chr(34), chr(92) + chr(34))}"' in directives(script)
    assert not marker.exists()


@pytest.mark.parametrize(
    ("field", "value"),
    [("name", "job\ntouch /tmp/owned"), ("cluster.partition", "gpu\rx"), ("run.dir", "runs\\x")],
)
def test_values_an_sbatch_line_cannot_carry_are_rejected_before_writing(
    tmp_path: Path, field: str, value: str
) -> None:
    cfg = slurm_recipe(device="cpu")
    run_dir = tmp_path / "run"
    if field == "name":
        cfg.name = value
    elif field == "cluster.partition":
        cfg.cluster.partition = value
    else:
        run_dir = tmp_path / value
    with pytest.raises(JobError) as err:
        write_run_dir(cfg, run_dir, "name: x\n")
    assert str(err.value).startswith(f"{field}=")
    assert "cannot carry line breaks, control characters or backslashes" in str(err.value)
    assert not run_dir.exists()


@pytest.mark.parametrize("key", ["A;B", "1X", "X Y", "$(id)", ""])
def test_env_keys_must_be_identifiers(tmp_path: Path, key: str) -> None:
    cfg = slurm_recipe(device="cpu", env={key: "1"})
    with pytest.raises(JobError, match="not a valid environment variable name"):
        write_run_dir(cfg, tmp_path / "run", "name: x\n")


def test_run_dir_holds_the_config_the_script_and_a_log_dir(tmp_path: Path) -> None:
    files = write_run_dir(slurm_recipe(device="cpu"), tmp_path / "run", "name: a\n")
    assert files.config_path.read_text() == "name: a\n"
    assert sorted(p.name for p in files.run_dir.iterdir()) == ["config.yaml", "job.sbatch", "logs"]
    assert files.script_path == files.run_dir / "job.sbatch"


def test_local_run_script_is_the_torchrun_command_with_the_environment(tmp_path: Path) -> None:
    cfg = RecipeConfig()
    cfg.cluster.gpus_per_node = 2
    cfg.cluster.omp_num_threads = 3
    cfg.cluster.env = {"NCCL_DEBUG": "WARN"}
    files = write_run_dir(cfg, tmp_path / "run", "name: a\n")
    script = files.script_path.read_text()
    assert files.script_path.name == "run.sh"
    assert os.access(files.script_path, os.X_OK)
    lines = script.splitlines()
    assert "export OMP_NUM_THREADS=3" in lines
    assert "export NCCL_DEBUG=WARN" in lines
    assert lines[-1] == "exec " + shlex.join(local_command(cfg, files.config_path))
    subprocess.run(["bash", "-n", str(files.script_path)], check=True)


def test_a_different_config_in_an_existing_run_dir_is_refused_and_kept(tmp_path: Path) -> None:
    cfg = slurm_recipe(device="cpu")
    first = write_run_dir(cfg, tmp_path / "run", "seed: 3\n")
    with pytest.raises(JobError, match=r"holds a different config.*not seed.*run\.dir=.*remove"):
        write_run_dir(cfg, tmp_path / "run", "seed: 4\n")
    assert first.config_path.read_text() == "seed: 3\n"


def test_the_same_config_again_is_a_resubmission_and_accepted(tmp_path: Path) -> None:
    cfg = slurm_recipe(device="cpu")
    first = write_run_dir(cfg, tmp_path / "run", "name: a\n")
    again = write_run_dir(cfg, tmp_path / "run", "name: a\n")
    assert again == first
    assert again.config_path.read_text() == "name: a\n"


def test_local_backend_refuses_more_than_one_node(tmp_path: Path) -> None:
    cfg = RecipeConfig()
    cfg.cluster.nodes = 2
    with pytest.raises(JobError, match=r"cluster\.nodes=2 with cluster\.backend=local"):
        write_run_dir(cfg, tmp_path / "run", "name: a\n")


LAUNCHER = """
import sys
from pathlib import Path
from pretrain.launcher.job.backends import run_local
from pretrain.launcher.job.run_dir import write_run_dir
from pretrain.core.schema import RecipeConfig, dump_config

cfg = RecipeConfig()
cfg.cluster.device, cfg.cluster.gpu_type, cfg.cluster.gpus_per_node = "cpu", "cpu", 2
cfg.train.steps, cfg.logging.wandb, cfg.run.dir = 100_000, "disabled", sys.argv[1]
files = write_run_dir(cfg, Path(cfg.run.dir), dump_config(cfg))
sys.exit(run_local(files, cfg).code)
"""


@pytest.mark.distributed
def test_ctrl_c_reaches_torchrun_and_every_rank_stops(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(run_dir)])
    try:
        deadline = time.monotonic() + 120
        metrics = run_dir / "metrics.jsonl"
        while not (metrics.exists() and metrics.read_text()) and time.monotonic() < deadline:
            assert launcher.poll() is None, "training stopped before the signal"
            time.sleep(0.2)
        [torchrun] = map(
            int, Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read_text().split()
        )
        launcher.send_signal(signal.SIGINT)
        code = launcher.wait(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert code != 0
    # Every process of torchrun's group, and every process of the run, exits (waited for:
    # the ranks stop in their own time on a loaded machine).
    assert wait_until_gone(group=torchrun) == []
    assert wait_until_gone(mentioning=str(run_dir / "config.yaml")) == []


STUB_SLURM = """#!/bin/bash
# A stand-in for srun and scontrol: records its arguments, answers what the job script asks.
echo "$(basename "$0") $*" >>"$CALLS"
case "$(basename "$0") $1 $2" in
    "scontrol show hostnames") echo node1 ;;
    "scontrol show node") echo "NodeName=node1 NodeAddr=10.0.0.7 State=IDLE" ;;
    srun*) exit "$SRUN_STATUS" ;;
esac
"""


@pytest.mark.parametrize(
    ("srun_status", "marker", "requeued", "exit_code"),
    [
        (0, True, True, 0),
        (1, True, True, 0),  # the ranks saved, yet a node's agent reported a failure
        (0, False, False, 0),
        (3, False, False, 3),
    ],
)
def test_the_job_requeues_whenever_the_trainer_left_the_preempted_marker(
    tmp_path: Path, srun_status: int, marker: bool, requeued: bool, exit_code: int
) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("srun", "scontrol"):
        (bin_dir / name).write_text(STUB_SLURM)
        (bin_dir / name).chmod(0o755)
    files = write_run_dir(slurm_recipe(device="cpu", nodes=2), tmp_path / "run", "name: a\n")
    if marker:
        (files.run_dir / "preempted").write_text("7\n")
    calls = tmp_path / "calls"
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "CALLS": str(calls),
        "SRUN_STATUS": str(srun_status),
        "SLURM_JOB_ID": "42",
        "SLURM_JOB_NODELIST": "node[1-2]",
        "SLURM_JOB_NUM_NODES": "2",
    }
    result = subprocess.run(["bash", str(files.script_path)], env=env, capture_output=True)
    assert result.returncode == exit_code
    assert ("scontrol requeue 42" in calls.read_text().splitlines()) == requeued


def test_one_rank_that_is_never_restarted_runs_without_the_agent(tmp_path: Path) -> None:
    cfg = RecipeConfig()
    cfg.cluster.gpus_per_node = 1
    config = tmp_path / "config.yaml"
    assert local_command(cfg, config) == [sys.executable, "-m", "pretrain.trainer", str(config)]
    cfg.cluster.max_restarts = 2  # torchrun restarts the group: the agent stays
    assert local_command(cfg, config) == torchrun_args(cfg, config)
    cfg.cluster.max_restarts, cfg.cluster.gpus_per_node = 0, 2
    assert local_command(cfg, config) == torchrun_args(cfg, config)


def test_a_launch_log_on_a_full_disk_stops_with_a_warning_and_never_raises(capsys) -> None:
    from pretrain.launcher.job.backends import _LaunchLog

    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full here")
    log = _LaunchLog(Path("/dev/full"))
    log.write(b"a rank's line\n")
    log.write(b"the next one\n")
    log.close()
    said = capsys.readouterr().err
    assert said.count("the launch log stops here") == 1
    assert "/dev/full: the launch log stops here: No space left on device" in said
