"""Rules of the job's environment: cluster.env, secrets, the cluster's numeric settings and
the device of a local run.

cluster.env is written to config.yaml and exported by the job script, so it may hold
neither secrets (they belong in the environment the job inherits; SLURM propagates it)
nor variables that change how the job script and Python themselves start.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from pretrain.core.problems import Checks, or_list
from pretrain.core.schema import RecipeConfig

SECRET_NAME = re.compile(
    r"(^|_)(KEY|TOKEN)$|SECRET|PASSW(OR)?D|CREDENTIAL|^WANDB_API_KEY$|^HF_TOKEN$", re.I
)
"""Environment variable names that hold secrets (API keys, tokens, passwords)."""
_SCRIPT_NAMES = re.compile(
    r"^(PATH|ENV|BASH_ENV|SHELLOPTS|BASHOPTS|IFS|PS4|PROMPT_COMMAND)$|^(LD_|PYTHON|BASH_FUNC_)"
)
_TORCHRUN_NAMES = re.compile(
    r"^(RANK|LOCAL_RANK|WORLD_SIZE|LOCAL_WORLD_SIZE|GROUP_RANK|MASTER_ADDR|MASTER_PORT)$"
    r"|^TORCHELASTIC_|^PRETRAIN_RUN_LOCK$"
)
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
MIN_SECRET_CHARS = 8
"""Shorter values of secret-named variables are not looked for (they would match anywhere)."""
HIDDEN = "***"
"""How a secret value is shown in a message."""


def check_env(c: Checks, cfg: RecipeConfig, environ: Mapping[str, str] = os.environ) -> None:
    """cluster.env names and values, secrets anywhere in the recipe, the cluster's numbers."""
    for name, value in cfg.cluster.env.items():
        _check_env_entry(c, name, value)
    _check_secret_values(c, cfg, environ)
    k = cfg.cluster
    if not 0 <= k.master_port <= 65535:
        c.add(
            "cluster.master_port", k.master_port, "not a TCP port",
            "use 1-65535, or 0 for a port per job (the default)",
        )  # fmt: skip
    c.at_least("cluster.cpus_per_task", k.cpus_per_task, 1)
    c.at_least("cluster.signal_seconds", k.signal_seconds, 0)
    c.at_least("cluster.omp_num_threads", k.omp_num_threads, 1)


def _check_env_entry(c: Checks, name: str, value: str) -> None:
    field = f"cluster.env.{name}"
    if not _ENV_NAME.fullmatch(name):
        c.add(field, value, "not an environment variable name",
              "use letters, digits and '_', not starting with a digit")  # fmt: skip
    elif SECRET_NAME.search(name):
        c.add(
            field,
            HIDDEN,
            "looks like a secret, and cluster.env is written to config.yaml and the job script",
            f"export {name} in the environment you launch from instead: the ranks inherit "
            "it (SLURM propagates it to the job)",
        )
    elif _SCRIPT_NAMES.search(name):
        c.add(
            field,
            value,
            "would change how the job script and Python start (a BASH_ENV script runs, "
            "LD_* libraries load, PYTHON* variables swap the code), not just the ranks",
            "set it in your own environment if you mean it; cluster.env is for the ranks' "
            "libraries (NCCL_*, UCX_*, OMP_*, ...)",
        )
    elif _TORCHRUN_NAMES.search(name):
        c.add(field, value, "torchrun and the launcher set it for every rank",
              "remove it; the layout fields and cluster.master_port set these")  # fmt: skip
    elif "\x00" in value:
        c.add(field, value, "holds a NUL byte, which no environment variable can carry",
              "remove it")  # fmt: skip
    elif name == "OMP_NUM_THREADS" and not (value.isdigit() and int(value) >= 1):
        c.add(field, value, "not a positive number of threads", "use e.g. 1 or 4, or remove it")


def string_fields(node: Any, prefix: str = "") -> Iterator[tuple[str, str]]:
    """(dotted path, value) of every string in a recipe, inside lists and dicts too."""
    if dataclasses.is_dataclass(node):
        for f in dataclasses.fields(node):
            yield from string_fields(getattr(node, f.name), f"{prefix}{f.name}.")
    elif isinstance(node, dict):
        for key, value in node.items():
            yield from string_fields(value, f"{prefix}{key}.")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from string_fields(value, f"{prefix}{i}.")
    elif isinstance(node, str):
        yield prefix.rstrip("."), node


def _check_secret_values(c: Checks, cfg: RecipeConfig, environ: Mapping[str, str]) -> None:
    """No string of the recipe holds the value of a secret-named variable of this
    environment (an `${oc.env:HF_TOKEN}` or a pasted token would be written to files)."""
    secrets = {
        name: value for name, value in environ.items()
        if SECRET_NAME.search(name) and len(value) >= MIN_SECRET_CHARS
    }  # fmt: skip
    for path, text in string_fields(cfg):
        names = sorted(name for name, value in secrets.items() if value in text)
        if names and not c.reported(path):
            c.add(
                path,
                HIDDEN,
                f"holds the value of ${names[0]}, a secret, which would be written to "
                "config.yaml, the job script and W&B",
                f"leave it out: the ranks inherit {or_list(names)} from your environment",
            )


def check_local_device(c: Checks, cfg: RecipeConfig) -> None:
    """A local run on cuda needs CUDA devices on this machine (seen without importing
    torch: the driver's device files), as many as cluster.gpus_per_node."""
    if cfg.cluster.device != "cuda":
        return
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    found = len(list(Path("/proc/driver/nvidia/gpus").glob("*")))
    if Path("/dev/kfd").exists() and not found:
        return  # ROCm: torch.cuda drives AMD GPUs too; leave the count to the ranks
    if visible is not None:
        found = min(found, len([d for d in visible.split(",") if d.strip() not in ("", "-1")]))
    if found == 0:
        c.add(
            "cluster.device",
            "cuda",
            "this machine has no CUDA device"
            + (f" visible (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""),
            "use cluster.device=cpu to run on CPU, or cluster=slurm to submit to GPU nodes",
        )
    elif cfg.cluster.gpus_per_node > found:
        c.add(
            "cluster.gpus_per_node",
            cfg.cluster.gpus_per_node,
            f"this machine has {found} CUDA device{'s' * (found > 1)}",
            f"use cluster.gpus_per_node <= {found}",
        )
