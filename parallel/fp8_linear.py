"""Block-scaled FP8 linear layers through torchao: MXFP8 and 128 x 128 block FP8.

`BlockScaledLinear` keeps the `nn.Linear` it replaces (same weight and bias parameters, so
names, initialization and checkpoints do not change) and runs its matmuls through torchao's
autograd functions, which quantize the input, the weight and, in backward, the output
gradient per block:

- mxfp8 (`torchao.prototype.moe_training.mxfp8_linear`): a power-of-two (E8M0) scale per 32
  elements along the reduced dim, E4M3 values; Blackwell's block-scaled MMA, or torchao's
  emulation in plain PyTorch (`emulate`, for CPU tests);
- blockwise (`torchao.prototype.blockwise_fp8_training`): DeepSeek-V3's recipe, 1 x 128 tiles
  for activations and gradients, 128 x 128 blocks for weights; triton kernels and Hopper's
  block-scaled `scaled_mm`, so CUDA only.

Both take their operands in one dtype: under autocast (where FSDP does not cast the weights)
the input and the FP32 weight are cast to the autocast dtype first, as autocast would cast
them for a plain linear.

Under tensor parallelism the weight is a DTensor sharded by rows (a column-wise layer: the
input replicated, the output sharded on its last dim) or by columns (a row-wise layer: the
input sharded on its last dim, the output partial sums): the local shards are multiplied
and the output wrapped with that placement, and the replicated input's gradient is marked
partial, so the tensor-parallel plan's own redistributions reduce it. The blocks a shard is
quantized in are those of the whole matrix wherever each shard's width is whole blocks.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Shard

BLOCK = 128
"""The tile and block edge of the blockwise recipe."""


class BlockScaledLinear(nn.Linear):
    """A linear layer whose matmuls run in torchao's block-scaled FP8 (`recipe`)."""

    def __init__(self, old: nn.Linear, recipe: str, emulate: bool) -> None:
        super().__init__(old.in_features, old.out_features, bias=False, device=old.weight.device)
        self.weight, self.bias = old.weight, old.bias
        self.recipe = recipe
        self.emulate = emulate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.weight, DTensor):
            return self._sharded(x, self.weight)
        return self._local(x, self.weight, self.bias)

    def _local(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        if torch.is_autocast_enabled(x.device.type):
            dtype = torch.get_autocast_dtype(x.device.type)
            x, weight = x.to(dtype), weight.to(dtype)
        out = self._mm(x, weight)
        return out if bias is None else out + bias.to(out.dtype)

    def _sharded(self, x: torch.Tensor, weight: DTensor) -> DTensor:
        (placement,) = weight.placements
        columns = placement == Shard(0)  # rows of the weight: a column-wise layer
        if not columns and self.bias is not None:
            raise ValueError("a row-wise FP8 layer with a bias is not supported")
        if isinstance(x, DTensor):
            x = x.to_local(grad_placements=[Partial()] if columns else None)
        bias = self.bias.to_local() if isinstance(self.bias, DTensor) else self.bias
        out = self._local(x, weight.to_local(), bias)
        placements = [Shard(out.ndim - 1)] if columns else [Partial()]
        return DTensor.from_local(out, weight.device_mesh, placements, run_check=False)

    def _mm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.recipe == "mxfp8":
            from torchao.prototype.moe_training.mxfp8_linear import _to_mxfp8_then_scaled_mm
            from torchao.prototype.mx_formats.config import ScaleCalculationMode
            from torchao.quantization.quantize_.common import KernelPreference

            kernel = KernelPreference.EMULATED if self.emulate else KernelPreference.AUTO
            return _to_mxfp8_then_scaled_mm(x, weight, kernel, ScaleCalculationMode.RCEIL)
        from torchao.prototype.blockwise_fp8_training.linear import fp8_blockwise_mm

        shape = x.shape
        out = fp8_blockwise_mm.apply(x.reshape(-1, shape[-1]), weight, BLOCK, torch.bfloat16)
        return out.reshape(*shape[:-1], out.shape[-1])
