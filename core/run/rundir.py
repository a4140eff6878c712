"""Names of the files in a run dir that more than one package reads or writes.

The launcher writes the config and the job script, the trainer writes metrics, checkpoints
and markers, and the report, the exporter and the sbatch script read them back; each name
is spelled here once.
"""

from __future__ import annotations

CONFIG_FILE = "config.yaml"
"""The resolved recipe: the only config the ranks read."""
OVERRIDES_FILE = "overrides.yaml"
"""The recipe's name and the command line's overrides the run was launched with (the
previous ones kept as overrides.N.yaml beside config.N.yaml when the config changed)."""
LOCAL_SCRIPT = "run.sh"
"""The job script of a local run."""
SLURM_SCRIPT = "job.sbatch"
"""The job script of a SLURM run."""
METRICS_FILE = "metrics.jsonl"
"""One JSON object per logged step."""
CHECKPOINTS_DIR = "checkpoints"
"""Sharded checkpoints, one step_N folder each."""
HF_DIR = "hf"
"""Hugging Face folders the trainer writes (checkpoint.hf_every), one step_N folder each."""
LOGS_DIR = "logs"
"""SLURM's output files."""
PREEMPTED_MARKER = "preempted"
"""File the trainer leaves when it saved and stopped on SIGTERM/SIGUSR1; the sbatch script
requeues the job when it finds it."""
HANGS_DIR = "hangs"
"""Each rank's last collectives, written when it stalls or a collective fails (and, on CUDA,
NCCL's flight recorder dumps)."""
TENSORBOARD_DIR = "tensorboard"
"""TensorBoard event files of the main rank (logging.tensorboard=true)."""
SLURM_JOB_FILE = "slurm_job_id"
"""The id of the last SLURM job submitted for this run dir (`pretrain status` asks SLURM)."""
WANDB_ID_FILE = "wandb_run_id"
"""The W&B run id, kept so that a resumed run continues the same W&B run."""
PREPARE_CONFIG = "prepare.yaml"
"""The resolved recipe `action=prepare` tokenizes the data of."""
PREPARE_SCRIPT = "prepare.sbatch"
"""The CPU-only SLURM job script of `action=prepare cluster=slurm`."""
LOCK_FILE = "run.lock"
"""Held while a trainer owns the run dir: JSON naming the holder (core/run/run_lock.py)."""
PLAN_FILE = "plan.json"
"""The launcher's plan of the run (`plan_to_dict`); a rank that runs out of memory quotes
its predicted peak beside the measured one."""
LEDGER_FILE = "ledger.jsonl"
"""One JSON record per launch and per job: code version, package versions, hosts
(core/run/ledger.py); `pretrain diff` reads it."""
LAUNCH_LOG = "torchrun.log"
"""Under LOGS_DIR: everything torchrun and the ranks wrote to stderr in a local run."""


SHRUNK_CONFIG_PREFIX = "config-"
SHRUNK_CONFIG_SUFFIX = "-nodes.yaml"
"""config-N-nodes.yaml: the config a SLURM job continues with on N nodes after losing some
(cluster.min_nodes), the layout the launcher chose for them, beside CONFIG_FILE (not
config.N.yaml, the name of an earlier config of the run)."""


def shrunk_config(nodes: int) -> str:
    """The name of the config a job continues with on `nodes` nodes."""
    return f"{SHRUNK_CONFIG_PREFIX}{nodes}{SHRUNK_CONFIG_SUFFIX}"


def rank_log(rank: int) -> str:
    """Under LOGS_DIR: the full traceback of each failure of `rank`."""
    return f"rank_{rank}.log"


def failure_record(rank: int) -> str:
    """Under LOGS_DIR: the JSON summary of `rank`'s last failure (cause, fix, host), which
    the launcher prints."""
    return f"failure_rank_{rank}.json"


FAILURE_RECORD_GLOB = "failure_rank_*.json"
"""Matches every `failure_record` name."""
GOODPUT_FILE = "goodput.jsonl"
"""Where the run's wall time went: one event per line (core/run/goodput.py)."""
FAULTS_FILE = "faults.jsonl"
"""Every action taken on a NaN or a loss spike (skip, halt, rollback): one JSON object per
line, the file rewritten whole (trainer/faults/policies.py); `pretrain status` shows it."""
