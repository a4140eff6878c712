"""Facts about numeric precision that the rules, the runtime and the metrics share.

Which FP8 backends and scalings exist, what hardware they need, which package provides each
backend and how to install it, and which column of the GPU table MFU divides by.
"""

from __future__ import annotations

import importlib.util

from pretrain.core.schema import PrecisionConfig

FP8_RECIPES = {
    "torchao": ("current", "rowwise", "mxfp8", "blockwise"),
    "te": ("current", "delayed", "mxfp8", "blockwise"),
}
"""FP8 scalings each backend implements."""
FP8_MIN_CAPABILITY = (8, 9)
"""FP8 tensor cores: Ada and Hopper and newer."""
MXFP8_MIN_CAPABILITY = (10, 0)
"""MXFP8 block scaling: Blackwell and newer."""
SCALING_MIN_CAPABILITY = {"mxfp8": MXFP8_MIN_CAPABILITY, "blockwise": (9, 0)}
"""Scalings that need more than FP8 tensor cores: MXFP8 Blackwell's block-scaled MMA,
128 x 128 block FP8 Hopper's (torchao's kernels and Transformer Engine's Float8BlockScaling)."""
FP8_MULTIPLE = 16
"""FP8 matmuls need every dimension of the block's linear layers to be a multiple of 16."""
SCALING_MULTIPLE = {"mxfp8": 32, "blockwise": 128}
"""Block-scaled recipes need widths (and tokens) that are whole blocks: MX blocks of 32
elements, DeepSeek-V3's tiles of 128; the others FP8_MULTIPLE."""
EMULATED_SCALINGS = ("current", "rowwise", "mxfp8")
"""torchao scalings whose linear layers `fp8_emulate` runs on CPU. torchao's 128 x 128 block
FP8 (prototype.blockwise_fp8_training) quantizes with triton kernels and multiplies with
Hopper's block-scaled `scaled_mm`: nothing of it runs without a CUDA GPU."""
GROUPED_SCALINGS = ("rowwise", "mxfp8", "blockwise")
"""torchao scalings with an FP8 grouped GEMM (prototype.moe_training), which the routed
experts of a MoE model run through; under the others the experts stay in bf16."""
GROUPED_EMULATED = ("mxfp8",)
"""Of GROUPED_SCALINGS, those `fp8_emulate` runs on CPU: torchao emulates the MXFP8 grouped
GEMM in plain PyTorch; its rowwise and blockwise grouped GEMMs quantize with triton kernels
(and rowwise multiplies with torch._scaled_grouped_mm, compute capability 9.0)."""
GROUPED_MIN_CAPABILITY = {"rowwise": (9, 0), "blockwise": (9, 0), "mxfp8": (10, 0)}
"""The GPUs each FP8 grouped GEMM runs on."""
BACKEND_MODULES = {"torchao": "torchao", "te": "transformer_engine"}
"""The importable package behind each FP8 backend."""
BACKEND_INSTALL = {
    "torchao": "pip install torchao (the project's fp8 extra)",
    "te": "pip install 'transformer-engine[pytorch]' (the project's te extra) on a CUDA machine",
}
"""How to install each FP8 backend."""
COMPUTE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 2}
"""Bytes of an activation, key or value element in the compute dtype (FP8 runs keep BF16
activations and attend in BF16); every precision.dtype has an entry."""


def scaling_multiple(recipe: str) -> int:
    """What the widths of the FP8 linear layers (and the tokens they take) must divide by."""
    return SCALING_MULTIPLE.get(recipe, FP8_MULTIPLE)


def fp8_experts(precision: PrecisionConfig) -> bool:
    """Whether the routed experts of a MoE model run their grouped GEMM in FP8: under fp8 with
    torchao and a scaling that has an FP8 grouped GEMM."""
    return (
        precision.dtype == "fp8"
        and precision.fp8_backend == "torchao"
        and precision.fp8_recipe in GROUPED_SCALINGS
    )


def fp8_placement(precision: PrecisionConfig, moe: bool) -> str:
    """What computes in FP8 under `precision` (for the plan), or "" when it is not fp8."""
    if precision.dtype != "fp8":
        return ""
    where = "emulated" if precision.fp8_emulate else precision.fp8_backend
    fp8 = "the blocks' linear layers"
    rest = "attention scores, norms, embedding and LM head in bf16"
    if moe:
        experts = fp8_experts(precision)
        fp8 += " and the routed experts' grouped GEMMs" if experts else ""
        rest = ("" if experts else "the routed experts, ") + "the router, " + rest
    return f"{precision.fp8_recipe} scaling ({where}): {fp8} in FP8; {rest}"


def peak_dtype(precision: PrecisionConfig) -> str:
    """The column of the GPU table that MFU divides by: FP8 runs against the FP8 peak, except
    emulated FP8, whose matmuls run in bf16."""
    if precision.dtype == "fp8":
        return "bf16" if precision.fp8_emulate else "fp8"
    return precision.dtype


def backend_installed(backend: str) -> bool:
    """Whether the FP8 backend's package can be imported here (found without importing it)."""
    return importlib.util.find_spec(BACKEND_MODULES[backend]) is not None
