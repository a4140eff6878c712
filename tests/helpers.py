"""Builders and checks several test modules share (instead of importing each other)."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.memory_fit import check_fits
from launcher.validate import validate
from pretrain_core.model_config import ModelConfig
from pretrain_core.problems import Problem, RecipeError
from pretrain_core.schema import RecipeConfig

REPO = Path(__file__).resolve().parent.parent
# Published model shapes (parameter counts equal the Hugging Face checkpoints for Llama 3;
# GPT-3's and the 1T model's GeLU MLP of width 4h is a SwiGLU of width 8h/3: the same
# parameters and FLOPs).
LLAMA3_8B = ModelConfig(
    vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
    max_seq_len=8192, rope_theta=500000.0,
)  # fmt: skip
LLAMA3_405B = ModelConfig(
    vocab_size=128256, dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim=53248,
    max_seq_len=8192, rope_theta=500000.0,
)  # fmt: skip
LLAMA3_70B = ModelConfig(
    vocab_size=128256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672,
    max_seq_len=8192, rope_theta=500000.0,
)  # fmt: skip
GPT3_175B = ModelConfig(
    vocab_size=51200, dim=12288, n_layers=96, n_heads=96, ffn_dim=32768, max_seq_len=2048,
    tie_embeddings=True,
)  # fmt: skip
MEGATRON_1T = ModelConfig(
    vocab_size=51200, dim=25600, n_layers=128, n_heads=160, ffn_dim=68267, max_seq_len=2048,
    tie_embeddings=True,
)  # fmt: skip

RECIPES = sorted(p.stem for p in (REPO / "recipes").glob("*.yaml") if p.stem != "base")
"""The shipped top-level recipes."""


def validate_and_fit(cfg: RecipeConfig) -> None:
    """What `action=script` checks before writing anything: the rules, then the memory fit."""
    validate(cfg)
    check_fits(cfg)


def base() -> RecipeConfig:
    """A valid recipe: 8 GPUs on one node, a small model with 32 heads and 8 KV heads."""
    cfg = RecipeConfig(name="base")
    cfg.model = ModelConfig(
        vocab_size=4096, dim=512, n_layers=8, n_heads=32, n_kv_heads=8, ffn_dim=1024,
        max_seq_len=1024,
    )  # fmt: skip
    cfg.train.seq_len, cfg.train.micro_batch, cfg.train.global_batch = 256, 2, 64
    cfg.cluster.gpus_per_node = 8
    return cfg


def compose_recipe(name: str, overrides: list[str]) -> RecipeConfig:
    """A shipped recipe composed by Hydra with command-line overrides, as the CLI does."""
    from hydra import compose, initialize_config_dir

    import launcher.cli  # noqa: F401  (registers the recipe schema with Hydra)
    from pretrain_core.schema import to_recipe

    with initialize_config_dir(config_dir=str(REPO / "recipes"), version_base=None):
        return to_recipe(compose(config_name=name, overrides=overrides))


def configure(overrides: dict) -> RecipeConfig:
    """The base recipe with dotted-path overrides, as on a Hydra command line."""
    cfg = copy.deepcopy(base())
    for path, value in overrides.items():
        *parents, leaf = path.split(".")
        node = cfg
        for part in parents:
            node = getattr(node, part)
        setattr(node, leaf, value)
    return cfg


def problems(cfg: RecipeConfig, for_launch: bool = False) -> list[Problem]:
    """Every problem `validate` reports for `cfg` (which must have some), one per line."""
    with pytest.raises(RecipeError) as error:
        validate(cfg, for_launch=for_launch)
    assert str(error.value).splitlines() == [str(p) for p in error.value.problems]
    return error.value.problems


def pretrain(*args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run the `pretrain` CLI (as `python -m launcher`) in `cwd` and capture its output."""
    return subprocess.run(
        [sys.executable, "-m", "launcher", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
