"""Precision rules of a recipe that the launcher checks before anything runs (no torch).

FP8 runs where its backend can: torchao's float8 training on CUDA GPUs of compute capability
8.9 and newer (or emulated anywhere, when asked), Transformer Engine on CUDA only and, until it
is shown to work here on a GPU, without tensor parallelism. Block scaling needs more: MXFP8
Blackwell (or torchao's emulation), 128 x 128 block FP8 Hopper and CUDA (torchao has no
emulation of it), and whole blocks of 32 or 128 in every FP8 width and in the tokens. A MoE
model's routed experts run torchao's FP8 grouped GEMM of the scaling where it has one, and
only its MXFP8 one emulates. FP16 needs a sane loss scaler.

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
    EMULATED_SCALINGS,
    FP8_MIN_CAPABILITY,
    FP8_MULTIPLE,
    FP8_RECIPES,
    GROUPED_EMULATED,
    GROUPED_MIN_CAPABILITY,
    SCALING_MIN_CAPABILITY,
    backend_installed,
    fp8_experts,
    scaling_multiple,
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
    elif p.fp8_emulate and p.fp8_recipe in recipes and p.fp8_recipe not in EMULATED_SCALINGS:
        c.add(
            "precision.fp8_recipe",
            p.fp8_recipe,
            "torchao's 128 x 128 block FP8 (prototype.blockwise_fp8_training and its grouped "
            "GEMM) quantizes with triton kernels and multiplies with Hopper's block-scaled "
            "scaled_mm: it has no emulation, so fp8_emulate cannot run it on CPU",
            "run it on a GPU of compute capability >= 9.0 (fp8_emulate=false), or emulate "
            "block scaling with fp8_recipe=mxfp8",
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
    if cluster.device == "cpu" and p.fp8_recipe == "mxfp8" and cfg.compile.backend == "inductor":
        _check_mxfp8_compiled_on_cpu(c, cfg)
    _check_fp8_layout(c, cfg)
    if cfg.model.moe_experts > 0 and fp8_experts(p) and not c.reported("precision.fp8_recipe"):
        _check_fp8_experts(c, cfg)
    if cluster.backend == "local" and not backend_installed(p.fp8_backend):
        c.add(
            "precision.fp8_backend",
            p.fp8_backend,
            f"{BACKEND_MODULES[p.fp8_backend]} is not installed",
            BACKEND_INSTALL[p.fp8_backend]
            + ("" if p.fp8_backend == "torchao" else ", or use precision.fp8_backend=torchao"),
        )


def _check_mxfp8_compiled_on_cpu(c: Checks, cfg: RecipeConfig) -> None:
    """Inductor's CPU code generator has no type for MXFP8's block scales."""
    if cfg.compile.enabled and cfg.compile.blocks:
        c.add(
            "compile.blocks",
            True,
            "inductor compiles a CPU block to C++, which has no float8_e8m0fnu, the type of "
            "MXFP8's block scales ('torch.float8_e8m0fnu missing from DTYPE_TO_CPP', torch "
            "2.13); on CUDA its triton code has it",
            "set compile.blocks=false (the loss may still be compiled), compile.enabled=false "
            "or compile.backend=aot_eager, or run MXFP8 on a GPU",
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
    elif gpu.compute_capability < SCALING_MIN_CAPABILITY.get(p.fp8_recipe, (0, 0)):
        need = ".".join(map(str, SCALING_MIN_CAPABILITY[p.fp8_recipe]))
        what = {"mxfp8": "MXFP8", "blockwise": "128 x 128 block FP8"}[p.fp8_recipe]
        arch = {"mxfp8": "Blackwell", "blockwise": "Hopper"}[p.fp8_recipe]
        c.add(
            "precision.fp8_recipe",
            p.fp8_recipe,
            f"{what} needs compute capability >= {need} ({arch}); {gpu.name} has {major}.{minor}",
            "use fp8_recipe=current or "
            + ("delayed" if p.fp8_backend == "te" else "rowwise")
            + " on this GPU",
        )


def _check_fp8_experts(c: Checks, cfg: RecipeConfig) -> None:
    """The routed experts' FP8 grouped GEMM: where it runs, and whole blocks in its widths."""
    p, m, field = cfg.precision, cfg.model, "precision.fp8_recipe"
    kind = {"rowwise": "rowwise", "mxfp8": "MXFP8", "blockwise": "128 x 128 block"}
    if p.fp8_emulate and p.fp8_recipe not in GROUPED_EMULATED:
        c.add(
            field,
            p.fp8_recipe,
            f"a MoE model's routed experts run torchao's {kind[p.fp8_recipe]} FP8 grouped "
            "GEMM, which quantizes with triton kernels and multiplies with "
            "torch._scaled_grouped_mm (CUDA, compute capability >= 9.0): it has no emulation, "
            "so fp8_emulate cannot run it on CPU",
            "use fp8_recipe=mxfp8 (its grouped GEMM emulates), or current (the experts stay "
            "in bf16), or run on an FP8 GPU",
        )
        return
    gpu = hardware.GPUS.get(cfg.cluster.gpu_type)
    need = GROUPED_MIN_CAPABILITY[p.fp8_recipe]
    if cfg.cluster.device == "cuda" and not p.fp8_emulate and gpu and gpu.compute_capability < need:
        major, minor = gpu.compute_capability
        c.add(
            field,
            p.fp8_recipe,
            f"a MoE model's routed experts run torchao's {kind[p.fp8_recipe]} FP8 grouped GEMM, "
            f"which needs compute capability >= {need[0]}.{need[1]}; {gpu.name} has "
            f"{major}.{minor}",
            "use fp8_recipe=current on this GPU (the experts stay in bf16)",
        )
        return
    multiple = scaling_multiple(p.fp8_recipe)
    slice_width = m.expert_ffn_dim // max(cfg.parallel.etp, 1)
    if slice_width % multiple:
        c.add(
            "model.moe_ffn_dim",
            m.moe_ffn_dim,
            f"the routed experts' FP8 grouped GEMM ({p.fp8_recipe}) needs widths in whole "
            f"blocks of {multiple}; each rank's slice of an expert is {slice_width} wide "
            f"(expert width {m.expert_ffn_dim} / parallel.etp={cfg.parallel.etp})",
            f"use an expert width whose slice is a multiple of {multiple}, or "
            "precision.fp8_recipe=current (the experts stay in bf16)",
        )


def _check_fp8_layout(c: Checks, cfg: RecipeConfig) -> None:
    p, m = cfg.precision, cfg.model
    multiple = scaling_multiple(p.fp8_recipe)
    widths = {
        "model.dim": m.dim,
        "model.ffn_dim": m.ffn_dim,
        "model.n_kv_heads": m.kv_heads * m.head_dim if m.n_heads and m.dim % m.n_heads == 0 else 0,
    }
    scaling = "" if multiple == FP8_MULTIPLE else f" ({p.fp8_recipe} scaling)"
    for field, width in widths.items():
        if width % multiple:
            shown = getattr(m, field.split(".")[1])
            what = "key/value width (n_kv_heads x head_dim)" if "kv" in field else "width"
            c.add(
                field,
                shown,
                f"FP8 matmuls{scaling} need multiples of {multiple}; the {what} is {width}",
                f"use a {what} that is a multiple of {multiple}, or precision.dtype=bf16",
            )
    # A context-parallel rank multiplies its own chunk of each sequence.
    cp = max(cfg.parallel.cp, 1)
    tokens = cfg.train.micro_batch * cfg.train.seq_len // cp
    if tokens % multiple:
        per_rank = f" / cp {cp}" if cp > 1 else ""
        c.add(
            "train.micro_batch",
            cfg.train.micro_batch,
            f"FP8 matmuls{scaling} need each rank's tokens per micro-batch (micro_batch x "
            f"seq_len{per_rank} = {tokens}) to be a multiple of {multiple}",
            f"make micro_batch x seq_len{per_rank} a multiple of {multiple}",
        )
    tp = cfg.parallel.tp
    whole = not any(c.reported(field) for field in widths)
    if p.fp8_backend == "torchao" and multiple != FP8_MULTIPLE and tp > 1 and whole:
        # Each rank quantizes its shard: the split widths must be whole blocks too.
        split = {
            "the query width": m.n_heads * m.head_dim,
            "the key/value width": widths["model.n_kv_heads"],
            "model.ffn_dim": m.ffn_dim,
        }
        broken = [
            f"{name} {width} / {tp}" for name, width in split.items() if width % (tp * multiple)
        ]
        if broken:
            c.add(
                "parallel.tp",
                tp,
                f"splits the FP8 linear layers, whose shards must be whole {p.fp8_recipe} "
                f"blocks of {multiple}: {', '.join(broken)} is not",
                f"use a tp that leaves each shard a multiple of {multiple}, or parallel.tp=1",
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
