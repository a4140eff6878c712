"""Facts about numeric precision that the rules, the runtime and the metrics share.

Which FP8 backends and scalings exist, what hardware they need, which package provides each
backend and how to install it, and which column of the GPU table MFU divides by.
"""

from __future__ import annotations

import importlib.util

from pretrain.core.schema import PrecisionConfig

FP8_RECIPES = {"torchao": ("current", "rowwise"), "te": ("current", "delayed", "mxfp8")}
"""FP8 scalings each backend implements."""
FP8_MIN_CAPABILITY = (8, 9)
"""FP8 tensor cores: Ada and Hopper and newer."""
MXFP8_MIN_CAPABILITY = (10, 0)
"""MXFP8 block scaling: Blackwell and newer."""
FP8_MULTIPLE = 16
"""FP8 matmuls need every dimension of the block's linear layers to be a multiple of 16."""
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


def peak_dtype(precision: PrecisionConfig) -> str:
    """The column of the GPU table that MFU divides by: FP8 runs against the FP8 peak, except
    emulated FP8, whose matmuls run in bf16."""
    if precision.dtype == "fp8":
        return "bf16" if precision.fp8_emulate else "fp8"
    return precision.dtype


def backend_installed(backend: str) -> bool:
    """Whether the FP8 backend's package can be imported here (found without importing it)."""
    return importlib.util.find_spec(BACKEND_MODULES[backend]) is not None
