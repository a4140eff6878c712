"""The routed experts' grouped GEMMs in FP8, through torchao's MoE training kernels.

`Fp8Experts` is a `models.moe.ExpertsKernel`: it runs the SwiGLU experts on rows grouped by
expert with torchao's FP8 grouped GEMM of the recipe (torchao.prototype.moe_training):
rowwise scales (`_to_fp8_rowwise_then_scaled_grouped_mm`), MXFP8 blocks of 32
(`_to_mxfp8_then_scaled_grouped_mm`, emulated in plain PyTorch under `fp8_emulate`) or
DeepSeek-V3's 1 x 128 / 128 x 128 blocks (`_to_fp8_blockwise_then_scaled_grouped_mm`). Each
quantizes the rows, the weights and, in backward, the output gradient (and for the weight
gradient the rows again) along the recipe's blocks, so the weights stay FP32 masters (or
FSDP's bf16 copies) and nothing else of the model changes.

The kernels want every expert's group of rows to be whole blocks (16, 32 or 128 rows): the
rows are copied once into a buffer where each group starts at a multiple of the block and is
padded with zero rows, with static shapes (the buffer holds T + E x (block - 1) rows rounded up,
its last group takes the slack), and the outputs are gathered back; zero rows add nothing to
the outputs or to the weight gradients. No host sync: the offsets stay on the device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

GROUP_ALIGN = {"rowwise": 16, "mxfp8": 32, "blockwise": 128}
"""Rows per block of each recipe's grouped GEMM: the groups are padded to whole blocks."""


def aligned_rows(rows: int, groups: int, align: int) -> int:
    """Rows of a buffer that holds `rows` rows in `groups` groups each padded to whole blocks
    of `align`: the most padding they can need, rounded up to a block."""
    return -(-(rows + groups * (align - 1)) // align) * align


def aligned_groups(ends: torch.Tensor, rows: int, align: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For rows grouped by `ends` [E] (cumulative): where each row goes in a buffer of
    `aligned_rows` rows whose groups start at multiples of `align` ([rows] indices), and the
    buffer's group ends ([E] int32; the last group takes the buffer's slack)."""
    ends = ends.long()
    sizes = torch.diff(ends, prepend=ends.new_zeros(1))
    padded = (sizes + align - 1) // align * align
    padded_ends = padded.cumsum(0)
    index = torch.arange(rows, device=ends.device)
    group = torch.searchsorted(ends, index, right=True)
    dest = (padded_ends - padded)[group] + index - (ends - sizes)[group]
    padded_ends[-1] = aligned_rows(rows, ends.numel(), align)
    return dest, padded_ends.to(torch.int32)


class Fp8Experts:
    """Runs the SwiGLU experts with torchao's FP8 grouped GEMM of `recipe`."""

    def __init__(self, recipe: str, emulate: bool) -> None:
        self.recipe = recipe
        self.align = GROUP_ALIGN[recipe]
        self.emulate = emulate

    def __call__(
        self,
        x: torch.Tensor,
        w1: torch.Tensor,
        w3: torch.Tensor,
        w2: torch.Tensor,
        ends: torch.Tensor,
    ) -> torch.Tensor:
        dest, offs = aligned_groups(ends, x.shape[0], self.align)
        size = aligned_rows(x.shape[0], ends.numel(), self.align)
        rows = x.new_zeros(size, x.shape[1]).index_copy(0, dest, x)
        # The kernels take the weights as [E, K, N] views of contiguous [E, N, K] tensors.
        gate = self._mm(rows, w1.transpose(-2, -1), offs)
        up = self._mm(rows, w3.transpose(-2, -1), offs)
        out = self._mm(F.silu(gate) * up, w2.transpose(-2, -1), offs)
        return out[dest]

    def _mm(self, a: torch.Tensor, b_t: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        # Each kernel writes bf16 (the scaled grouped GEMMs, and the emulation's bf16 grouped
        # GEMM): the output comes back in the rows' dtype, as the bf16 path's does.
        bf16 = torch.bfloat16
        if self.recipe == "mxfp8":
            from torchao.prototype.moe_training import _to_mxfp8_then_scaled_grouped_mm
            from torchao.quantization.quantize_.common import KernelPreference

            kernel = KernelPreference.EMULATED if self.emulate else KernelPreference.AUTO
            out = _to_mxfp8_then_scaled_grouped_mm(
                a, b_t, offs, out_dtype=bf16, kernel_preference=kernel
            )
        elif self.recipe == "rowwise":
            from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm

            out = _to_fp8_rowwise_then_scaled_grouped_mm(
                a, b_t, offs, bf16, pad_token_groups_for_grouped_mm=False
            )
        else:
            from torchao.prototype.moe_training.blockwise_fp8.grouped_mm import (
                _to_fp8_blockwise_then_scaled_grouped_mm,
            )

            out = _to_fp8_blockwise_then_scaled_grouped_mm(
                a, b_t, offs, bf16, pad_token_groups_for_grouped_mm=False
            )
        return out.to(a.dtype)
