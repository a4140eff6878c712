"""Precision rules of a recipe that the launcher checks before anything runs (no torch).

FP8 runs where its backend can: torchao's float8 training on CUDA GPUs of compute capability
8.9 and newer (or emulated anywhere, when asked), Transformer Engine on CUDA only and, until it
is shown to work here on a GPU, without tensor parallelism. FP16 needs a sane loss scaler.

Whether the FP8 backend is installed is checked only for `cluster.backend=local`, where the
launcher and the ranks share this Python. A SLURM login node often lacks the GPU stack that the
compute nodes have, so there the check happens on the ranks, which fail at start with the same
message (`pretrain.parallel.precision.require_backend`).
"""

from __future__ import annotations

from pretrain.core import hardware
from pretrain.core.precision import (
    BACKEND_INSTALL,
    BACKEND_MODULES,
    FP8_MIN_CAPABILITY,
    FP8_MULTIPLE,
    FP8_RECIPES,
    MXFP8_MIN_CAPABILITY,
    backend_installed,
)
from pretrain.core.problems import Checks, or_list
from pretrain.core.schema import PrecisionConfig, RecipeConfig


def check_precision(c: Checks, cfg: RecipeConfig) -> None:
    """Every precision rule `cfg` breaks (the dtype's own choices are checked by the schema)."""
    p = cfg.precision
    _check_loss_scale(c, p)
    if p.dtype == "fp8":
        _check_fp8(c, cfg)
    else:
        for name in ("fp8_emulate", "fp8_all_gather"):
            if getattr(p, name):
                c.add(
                    f"precision.{name}",
                    True,
                    f"only applies to FP8 but precision.dtype={p.dtype}",
                    f"set precision.dtype=fp8, or precision.{name}=false",
                )
    gpu = hardware.GPUS.get(cfg.cluster.gpu_type)
    if p.dtype == "bf16" and cfg.cluster.device == "cuda" and gpu and not gpu.supports_bf16:
        major, minor = gpu.compute_capability
        c.add(
            "precision.dtype",
            p.dtype,
            f"{gpu.name} has no bf16 (compute capability {major}.{minor} < 8.0)",
            "use fp32 or fp16 on this GPU, or a GPU with compute capability >= 8.0",
        )


def _check_loss_scale(c: Checks, p: PrecisionConfig) -> None:
    if not p.loss_scale_init > 0:
        c.add("precision.loss_scale_init", p.loss_scale_init, "must be > 0", "use e.g. 65536")
    if not p.loss_scale_growth >= 1:
        c.add("precision.loss_scale_growth", p.loss_scale_growth, "must be >= 1", "use e.g. 2.0")
    if not 0 < p.loss_scale_backoff < 1:
        c.add(
            "precision.loss_scale_backoff",
            p.loss_scale_backoff,
            "must lie in (0, 1) so an overflow shrinks the scale",
            "use e.g. 0.5",
        )
    if p.loss_scale_interval < 1:
        c.add("precision.loss_scale_interval", p.loss_scale_interval, "must be >= 1", "use 2000")


def _check_fp8(c: Checks, cfg: RecipeConfig) -> None:
    p, cluster = cfg.precision, cfg.cluster
    if p.fp8_backend not in FP8_RECIPES:
        return  # the schema's choice check reports it
    recipes = FP8_RECIPES[p.fp8_backend]
    if p.fp8_recipe not in recipes:
        other = [b for b, r in FP8_RECIPES.items() if p.fp8_recipe in r]
        c.add(
            "precision.fp8_recipe",
            p.fp8_recipe,
            f"fp8_backend={p.fp8_backend} has no {p.fp8_recipe!r} scaling",
            f"use {or_list(list(recipes))}"
            + (f", or precision.fp8_backend={other[0]}" if other else ""),
        )
    if p.fp8_amax_history < 1:
        c.add("precision.fp8_amax_history", p.fp8_amax_history, "must be >= 1", "1024")
    if p.fp8_margin < 0:
        c.add("precision.fp8_margin", p.fp8_margin, "must be >= 0", "use 0")
    if p.fp8_emulate and p.fp8_backend != "torchao":
        c.add(
            "precision.fp8_emulate",
            True,
            "only torchao can emulate FP8; Transformer Engine needs FP8 hardware",
            "set precision.fp8_backend=torchao, or fp8_emulate=false on an FP8 GPU",
        )
    elif cluster.device != "cuda" and not p.fp8_emulate:
        c.add(
            "precision.dtype",
            p.dtype,
            f"FP8 needs a CUDA GPU (cluster.device={cluster.device})",
            "run on GPUs with compute capability >= 8.9 (H100, H200, L40S, B200), or emulate "
            "on CPU: precision.fp8_backend=torchao precision.fp8_emulate=true",
        )
    if cluster.device == "cuda" and not p.fp8_emulate:
        _check_fp8_gpu(c, cfg)
    _check_fp8_layout(c, cfg)
    if cluster.backend == "local" and not backend_installed(p.fp8_backend):
        c.add(
            "precision.fp8_backend",
            p.fp8_backend,
            f"{BACKEND_MODULES[p.fp8_backend]} is not installed",
            BACKEND_INSTALL[p.fp8_backend]
            + ("" if p.fp8_backend == "torchao" else ", or use precision.fp8_backend=torchao"),
        )


def _check_fp8_gpu(c: Checks, cfg: RecipeConfig) -> None:
    p, gpu = cfg.precision, hardware.GPUS.get(cfg.cluster.gpu_type)
    if gpu is None:
        return
    major, minor = gpu.compute_capability
    if gpu.compute_capability < FP8_MIN_CAPABILITY:
        c.add(
            "precision.dtype",
            p.dtype,
            f"{gpu.name} has no FP8 tensor cores (compute capability {major}.{minor} < 8.9)",
            "use bf16 on this GPU (fp16 below 8.0), or an H100, H200, L40S or B200",
        )
    elif p.fp8_recipe == "mxfp8" and gpu.compute_capability < MXFP8_MIN_CAPABILITY:
        c.add(
            "precision.fp8_recipe",
            p.fp8_recipe,
            f"MXFP8 needs compute capability >= 10.0 (Blackwell); {gpu.name} has {major}.{minor}",
            "use fp8_recipe=current or delayed on this GPU",
        )


def _check_fp8_layout(c: Checks, cfg: RecipeConfig) -> None:
    p, m = cfg.precision, cfg.model
    widths = {
        "model.dim": m.dim,
        "model.ffn_dim": m.ffn_dim,
        "model.n_kv_heads": m.kv_heads * m.head_dim if m.n_heads and m.dim % m.n_heads == 0 else 0,
    }
    for field, width in widths.items():
        if width % FP8_MULTIPLE:
            shown = getattr(m, field.split(".")[1])
            what = "key/value width (n_kv_heads x head_dim)" if "kv" in field else "width"
            c.add(
                field,
                shown,
                f"FP8 matmuls need multiples of {FP8_MULTIPLE}; the {what} is {width}",
                f"use a {what} that is a multiple of {FP8_MULTIPLE}, or precision.dtype=bf16",
            )
    tokens = cfg.train.micro_batch * cfg.train.seq_len
    if tokens % FP8_MULTIPLE:
        c.add(
            "train.micro_batch",
            cfg.train.micro_batch,
            f"FP8 matmuls need tokens per micro-batch (micro_batch x seq_len = {tokens}) to "
            f"be a multiple of {FP8_MULTIPLE}",
            f"make micro_batch x seq_len a multiple of {FP8_MULTIPLE}",
        )
    if p.fp8_backend == "te" and cfg.parallel.tp > 1:
        c.add(
            "parallel.tp",
            cfg.parallel.tp,
            "Transformer Engine FP8 with tensor parallelism is not wired up in this trainer",
            "use precision.fp8_backend=torchao (DTensor TP), or parallel.tp=1",
        )
    if p.fp8_all_gather:
        if p.fp8_backend != "torchao" or p.fp8_recipe != "current":
            c.add(
                "precision.fp8_all_gather",
                True,
                "FP8 all-gather is torchao's, with per-tensor (current) scaling only",
                "set precision.fp8_backend=torchao fp8_recipe=current, or fp8_all_gather=false",
            )
        elif cfg.parallel.zero < 2:
            c.add(
                "precision.fp8_all_gather",
                True,
                f"all-gathers weights under FSDP (ZeRO-2/3); parallel.zero={cfg.parallel.zero}",
                "set parallel.zero=2 or 3, or fp8_all_gather=false",
            )
