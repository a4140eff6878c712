"""Compute seconds of a training step, kernel by kernel, for the cost model
(`pretrain.launcher.plan.cost`).

One micro-batch on one pipeline rank runs, per block:

- the linear layers' three GEMMs each, at their real shapes on the rank: the forward
  (m tokens x k in) @ (k x n out), the input gradient (m x n) @ (n x k) and the weight
  gradient (k x m) @ (m x n). The rows m are the micro-batch's tokens on the rank (b s / cp:
  sequence parallelism gathers the sequence back before each column-parallel GEMM); tp
  splits n of the column-parallel layers (Q/K/V, gate/up) and k of the row-parallel ones
  (the output projection, down). A MoE layer is whole on every TP rank (parallel/expert.py):
  its router and shared experts see every token, and its routed experts run as grouped GEMMs
  over the rows the dispatch brings (top_k x the dispatch's padding per token, spread over
  the rank's experts). Under FP8 the blocks' `nn.Linear` layers run at the FP8 rate
  (parallel/precision.py `fp8_candidate`), with the casts' memory traffic; the routed
  experts, attention and the LM head stay BF16.
- attention at the fused causal kernel's own rate (the causal half of the score square),
  forward and backward, and the forward again where recomputed (selective recompute runs
  the routed experts' grouped GEMMs again too, and under tp the attention's output
  projection: parallel/recompute.py);
- element-wise work (norms, rotary, the MLP's activation, residual adds, the MoE dispatch's
  copies) at the memory bandwidth: forward bytes once, backward twice (each op's backward
  reads the output gradient and the saved input and writes the input gradient), and the
  forward's again under full recompute.

The last pipeline rank adds the LM head (three GEMMs, BF16) and the loss's passes over the
FP32 logits; every step adds the optimizer's update over the rank's shard of the states at
the memory bandwidth.

A GEMM's time is the larger of its FLOPs at the device's rate and its operands' bytes at the
memory bandwidth (the roofline). The rate is the best-shaped GEMM's (`KernelRates.gemm_share`
of the peak) times the useful share of its last wave: cuBLAS splits the output into tiles
of 128 x 256 (or 256 x 128, or 128 x 128, whichever wastes least), one per SM at a time,
and a partial last wave or a partial tile still costs a whole one (tile and wave
quantization: Anthony et al. 2024, "The Case for Co-Designing Model Architectures with
Hardware", section 4). The constants per GPU live in `pretrain.core.hardware.KERNELS`, each
with its source.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from pretrain.core import hardware
from pretrain.core.hardware import KernelRates
from pretrain.core.layout import Degrees
from pretrain.core.model_config import ModelConfig
from pretrain.core.optim_states import state_bytes, state_tensors
from pretrain.core.precision import COMPUTE_BYTES
from pretrain.core.schema import RecipeConfig

TILES = ((128, 256), (256, 128), (128, 128))
"""Output tiles a GEMM library picks from (CUTLASS's and cuBLAS's common Ampere/Hopper BF16
tiles), the one with the least quantization waste for each shape."""
GEMM_BYTES = {"fp8": 1, "bf16": 2, "fp16": 2, "fp32": 4}
"""Bytes per operand element of a GEMM in each dtype."""
BACKWARD_BYTES = 2.0
"""Backward traffic of an element-wise op over its forward's (two reads and a write per
element against one and one)."""
ATTENTION_BACKWARD = 2.5
"""FLOPs of fused attention's backward over its forward (it recomputes the scores: five
matmuls against two; the FlashAttention papers' convention)."""
ACTIVATION_BYTES = 2.0
"""Bytes of an activation element in the element-wise ops (16-bit; FP8 runs keep their
activations in BF16, and FP32 runs are priced alike: their GEMMs dominate)."""
LOGIT_PASSES = 14
"""Bytes per logit per token on the last rank: the FP32 logits written and read by the
loss's forward (4 + 4), read again and their gradient written in backward (4 + 2)."""


@dataclass(frozen=True)
class Kernels:
    """One device's kernel rates, ready to price work: dense peaks and the rates the step's
    kernels reach."""

    peak: dict[str, float]
    """Dense peak TFLOP/s by dtype."""
    rates: KernelRates
    source: str = "the GPU table (core/hardware.py KERNELS)"
    gemm_tflops: tuple[tuple[float, float], ...] = field(default=())
    """Measured (FLOPs of one GEMM, TFLOP/s) points, smallest first; empty on a GPU of the
    table (its rates come from the shape model)."""
    op_s: float = 0.0
    """Seconds each dispatched operator costs beyond its arithmetic (a calibration's; 0
    for the GPU table, whose kernels run behind their launches)."""
    step_ops: Callable[[RecipeConfig], tuple[int, int]] | None = field(default=None, compare=False)
    """Operators a step of a recipe's layout dispatches, and of them those on DTensors (a
    calibration's count, 0 where it did not time the layout)."""
    loss_tbs: float = 0.0
    """TB/s the loss streams its logits at, where measured apart (a calibration's); else
    the memory bandwidth."""
    fsdp_call_s: float = 0.0
    """Seconds each FSDP2 collective costs beyond its bytes (a calibration's; 0 for the GPU
    table, where that host work runs behind the kernels)."""
    dtensor_op_s: float = 0.0
    """Seconds each operator on DTensors costs beyond its arithmetic (a calibration's)."""
    tp_call_s: float = 0.0
    """Seconds each tensor-parallel collective costs beyond its bytes as DTensor issues it
    (a calibration's; 0: a latency per ring step)."""
    blocks: dict = field(default_factory=dict, compare=False, repr=False)
    """Block seconds already priced on this device, by what they depend on (a layout search
    prices the same block shapes for thousands of layouts)."""

    def gemm(self, m: float, n: float, k: float, dtype: str) -> float:
        """Seconds of one (m x k) @ (k x n) GEMM in `dtype`."""
        if m <= 0 or n <= 0 or k <= 0:
            return 0.0
        flops = 2.0 * m * n * k
        if self.gemm_tflops:
            return flops / (_interpolate(self.gemm_tflops, flops) * 1e12)
        peak = self.peak.get(dtype) or self.peak["bf16"]
        share, (bm, bn, bk) = self.rates.gemm.get(dtype) or self.rates.gemm["bf16"]
        # The best shape's rate, less this shape's tile, wave and output-write losses against
        # the best shape's (its measurement paid those already).
        sms, balance = self.rates.sms, peak / self.rates.hbm_tbs
        shape = _quantization(m, n, sms) * _drain(k, balance)
        best = _quantization(bm, bn, sms) * _drain(bk, balance)
        compute = flops / (peak * 1e12 * share * shape / best)
        operands = GEMM_BYTES.get(dtype, 2) * (m * k + k * n) + 2 * m * n
        return max(compute, self.memory(operands))

    def attention(self, flops: float, seq: float) -> float:
        """Seconds of `flops` of fused causal attention (forward and backward as FlashAttention
        counts them) whose queries meet `seq` keys."""
        return flops / (_interpolate(self.rates.attention_tflops, seq) * 1e12)

    def memory(self, nbytes: float) -> float:
        """Seconds to stream `nbytes` through device memory once."""
        return nbytes / (self.rates.hbm_tbs * 1e12)


def _quantization(m: float, n: float, sms: int | None) -> float:
    """The useful share of the tiles a GEMM with an m x n output runs: the best tile's
    (tile quantization) times its last wave's (wave quantization)."""
    best = 0.0
    for tm, tn in TILES:
        rows, cols = math.ceil(m / tm), math.ceil(n / tn)
        share = m * n / (rows * tm * cols * tn)
        if sms:
            tiles = rows * cols
            share *= tiles / (math.ceil(tiles / sms) * sms)
        best = max(best, share)
    return best


def _drain(k: float, balance: float) -> float:
    """The share of a tile's time spent in its K loop rather than writing its output: after
    the loop a tile writes its Tm x Tn 16-bit outputs at its SM's share of the memory
    bandwidth, as long as `balance` (peak FLOP/s over bytes/s) more columns of K would take
    (2 bytes per output against 2 FLOPs per output and column)."""
    return k / (k + balance)


def _interpolate(points: tuple[tuple[float, float], ...], x: float) -> float:
    """Linear interpolation over log x between measured points, flat beyond the ends."""
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in itertools.pairwise(points):
        if x <= x1:
            t = math.log(x / x0) / math.log(x1 / x0)
            return y0 + t * (y1 - y0)
    return points[-1][1]


def gpu_kernels(cfg: RecipeConfig, peak_tflops: float) -> Kernels:
    """The kernels of `cfg.cluster.gpu_type` from the table; `peak_tflops` (the compute
    dtype's, possibly the recipe's `hardware.peak_tflops`) replaces that dtype's peak. One
    object per device and peak, so the blocks it prices are priced once."""
    key = (cfg.cluster.gpu_type, gemm_dtype(cfg), peak_tflops)
    if key not in _DEVICES:
        spec = hardware.gpu_spec(cfg.cluster.gpu_type)
        rates = hardware.kernel_rates(spec.name)
        if rates is None:
            # No kernel figures (V100): every GEMM at the peak, memory at no cost (a bound).
            rates = KernelRates(None, math.inf, {"bf16": (1.0, (1, 1, 1))}, ((1, peak_tflops),))
        peak = dict(spec.peak_tflops)
        peak[key[1]] = peak_tflops
        peak.setdefault("bf16", peak_tflops)
        _DEVICES[key] = Kernels(peak, rates)
    kernels = _DEVICES[key]
    if len(kernels.blocks) > MAX_PRICED:
        kernels.blocks.clear()
    return kernels


_DEVICES: dict[tuple[str, str, float], Kernels] = {}
MAX_PRICED = 65536
"""Priced blocks a device keeps before it forgets them all."""


def gemm_dtype(cfg: RecipeConfig) -> str:
    """The dtype the blocks' linear layers run in."""
    p = cfg.precision
    if p.dtype == "fp8":
        return "bf16" if p.fp8_emulate else "fp8"
    return p.dtype


@dataclass(frozen=True)
class Linear:
    """One linear layer of a block as one rank runs it."""

    k: int
    """Input features on the rank."""
    n: int
    """Output features on the rank."""
    rows: float = 1.0
    """GEMM rows per token of the micro-batch (top_k x padding for routed experts)."""
    groups: int = 1
    """A grouped GEMM: this many GEMMs (local experts) sharing the rows evenly."""
    fp8: bool = True
    """Whether the layer runs in FP8 under precision.dtype=fp8."""
    routed: bool = False
    """A routed experts' grouped GEMM: selective recompute runs it again."""


@dataclass(frozen=True)
class BlockWork:
    """A block's work per token of the micro-batch on one rank."""

    linears: tuple[Linear, ...]
    elementwise_bytes: float
    """Forward bytes per token of the memory-bound ops."""
    output_projection: int = -1
    """Index in `linears` of the attention's output projection (wo), which selective
    recompute runs again under tensor parallelism (parallel/recompute.py); -1 for none."""


@dataclass(frozen=True)
class BlockSeconds:
    """Seconds of one block for one micro-batch on one rank."""

    forward: float
    backward: float
    recompute: float
    """The forward again under full recompute (the attention's and the routed experts' under
    selective)."""
    attention: float
    """The attention kernel's forward + backward (what a K/V ring hop hides behind)."""


def block_work(
    m: ModelConfig,
    moe: bool,
    degrees: Degrees,
    sp: bool,
    padding: float,
    experts_fp8: bool = False,
) -> BlockWork:
    """The linears and element-wise bytes per token of a block (a MoE one where `moe`) on a
    rank of `degrees` (see the module's model); `experts_fp8`: the routed experts' grouped
    GEMMs run in FP8 under precision.dtype=fp8 (`pretrain.core.precision.fp8_experts`)."""
    t, ep = degrees.tp, degrees.ep
    h, heads = m.dim, m.n_heads
    linears: list[Linear] = []
    if m.is_mla:
        q_width = heads * m.qk_head_dim
        if m.mla_q_rank:
            linears += [Linear(h, m.mla_q_rank), Linear(m.mla_q_rank, q_width // t)]
        else:
            linears.append(Linear(h, q_width // t))
        linears += [
            Linear(h, m.kv_rank + m.rope_dim),
            Linear(m.kv_rank, heads * (m.nope_dim + m.v_head_dim) // t),
            Linear(heads * m.v_head_dim // t, h),
        ]
        rotary = heads * m.rope_dim // t + m.rope_dim
    else:
        q, kv = heads * m.head_dim, m.kv_heads * m.head_dim
        linears += [Linear(h, q // t), Linear(h, kv // t), Linear(h, kv // t), Linear(q // t, h)]
        rotary = (q + kv) // t
    output = len(linears) - 1  # wo: the attention's last linear
    # Two norms (a read and a write of h each) and two residual adds (two reads, a write)
    # run on the sequence shard under SP, on every token without; rotary reads and writes
    # the rank's queries and keys.
    split = t if sp else 1
    elementwise = ACTIVATION_BYTES * ((4 * h + 6 * h) / split + 2 * rotary)
    if moe:
        # etp splits each routed expert's hidden width; the shared experts stay whole.
        f, k = m.expert_ffn_dim, m.moe_top_k
        local, routed = max(1, m.moe_experts // ep), m.expert_ffn_dim // degrees.etp
        rows = k * padding
        linears += [
            Linear(h, m.moe_experts),
            Linear(h, routed, rows, local, fp8=experts_fp8, routed=True),
            Linear(h, routed, rows, local, fp8=experts_fp8, routed=True),
            Linear(routed, h, rows, local, fp8=experts_fp8, routed=True),
        ]
        shared = m.moe_shared_experts * f
        if shared:
            linears += [Linear(h, shared), Linear(h, shared), Linear(shared, h)]
        # SwiGLU over the routed rows and the shared width; the dispatch copies each row into
        # its send buffer and the combine reads it back and adds it, weighted.
        elementwise += ACTIVATION_BYTES * (3 * (rows * routed + shared) + 4 * rows * h)
    else:
        f = m.ffn_dim // t
        if m.mlp == "swiglu":
            linears += [Linear(h, f), Linear(h, f), Linear(f, h)]
            elementwise += ACTIVATION_BYTES * 3 * f
        else:
            linears += [Linear(h, f), Linear(f, h)]
            elementwise += ACTIVATION_BYTES * 2 * f
    return BlockWork(tuple(linears), elementwise, output)


def attention_per_token(m: ModelConfig, seq: int, t: int) -> tuple[float, float]:
    """(forward FLOPs per token the causal kernel computes on a rank of tp `t`, the keys a
    query meets): the score square's causal half (under a sliding window w, w - w^2 / 2s keys
    per query on average) over the rank's heads."""
    window = min(seq, m.sliding_window) if m.sliding_window else seq
    keys = window - window * window / (2 * seq)
    return 2 * keys * m.n_heads * (m.qk_head_dim + m.v_head_dim) / t, window


def block_seconds(
    kernels: Kernels,
    cfg: RecipeConfig,
    degrees: Degrees,
    work: BlockWork,
    tokens: float,
    recomputed: bool,
) -> BlockSeconds:
    """Seconds of a block with `work` over `tokens` tokens (one micro-batch on one rank)."""
    dtype = gemm_dtype(cfg)
    forward = backward = cast = routed = 0.0
    for lin in work.linears:
        rows = tokens * lin.rows / lin.groups
        kind = "bf16" if dtype == "fp8" and not lin.fp8 else dtype
        gemm = lin.groups * kernels.gemm(rows, lin.n, lin.k, kind)
        forward += gemm
        routed += gemm if lin.routed else 0.0
        backward += lin.groups * (
            kernels.gemm(rows, lin.k, lin.n, kind) + kernels.gemm(lin.k, lin.n, rows, kind)
        )
        if kind == "fp8":
            # Scaling casts, fused with a transpose for the weight gradient (Transformer
            # Engine's cast_transpose): the 16-bit input and output gradient are read once and
            # written twice in FP8 (4 bytes per element); the weight likewise once per
            # micro-batch.
            cast += 4 * (rows * lin.groups * (lin.k + lin.n) + lin.k * lin.n)
    flops, keys = attention_per_token(cfg.model, cfg.train.seq_len, degrees.tp)
    # Under cp each rank's queries meet the keys chunk by chunk (s / cp of them at a time).
    fwd_attention = kernels.attention(tokens * flops, keys / degrees.cp)
    elementwise = kernels.memory(tokens * work.elementwise_bytes)
    casts = kernels.memory(cast)
    forward += fwd_attention + elementwise + casts / 3
    backward += ATTENTION_BACKWARD * fwd_attention + BACKWARD_BYTES * elementwise + 2 * casts / 3
    recompute = 0.0
    if recomputed and cfg.recompute.policy == "full":
        recompute = forward
    elif recomputed and cfg.recompute.policy == "selective":
        # It keeps no grouped GEMM's output: the routed experts run again (their dispatch
        # too, which `launcher/plan/comm/ep.py` counts).
        recompute = fwd_attention + routed
        if degrees.tp > 1 and work.output_projection >= 0:
            # It keeps wo's reduced output, not its partial sums: wo runs again.
            wo = work.linears[work.output_projection]
            kind = "bf16" if dtype == "fp8" and not wo.fp8 else dtype
            recompute += kernels.gemm(tokens * wo.rows, wo.n, wo.k, kind)
    return BlockSeconds(forward, backward, recompute, (1 + ATTENTION_BACKWARD) * fwd_attention)


def head_seconds(kernels: Kernels, cfg: RecipeConfig, tokens: float, t: int) -> tuple[float, float]:
    """(forward, backward) seconds of the final norm, LM head and loss for `tokens` tokens on
    the last rank: three BF16 GEMMs over the rank's vocabulary shard and the loss's passes
    over the FP32 logits."""
    m = cfg.model
    vocab = math.ceil(m.vocab_size / t)
    dtype = "fp32" if cfg.precision.dtype == "fp32" else "bf16"
    forward = kernels.gemm(tokens, vocab, m.dim, dtype)
    backward = kernels.gemm(tokens, m.dim, vocab, dtype) + kernels.gemm(m.dim, vocab, tokens, dtype)
    logits = tokens * vocab * LOGIT_PASSES
    logits = logits / (kernels.loss_tbs * 1e12) if kernels.loss_tbs else kernels.memory(logits)
    return forward + logits * 8 / LOGIT_PASSES, backward + logits * 6 / LOGIT_PASSES


def optimizer_seconds(kernels: Kernels, cfg: RecipeConfig, params: float) -> float:
    """Seconds of one optimizer step over `params` parameters (the rank's shard): the FP32
    parameter, its gradient (read twice: the clipping norm, the update) and each state read,
    the parameter and states written, and the compute-dtype copy written."""
    moments = state_tensors(cfg.optim)[0]
    state = state_bytes(cfg.optim.state_dtype)
    copy = COMPUTE_BYTES[cfg.precision.dtype] if cfg.precision.dtype != "fp32" else 0
    per_param = 4 + 2 * 4 + 2 * moments * state + 4 + copy
    return kernels.memory(params * per_param)


def compute_assumption(gpu_type: str, dtype: str, kernels: Kernels) -> str:
    """The compute model's figures for a device, in one line."""
    if kernels.gemm_tflops:
        low, high = kernels.gemm_tflops[0][1], kernels.gemm_tflops[-1][1]
        return (
            f"compute kernel by kernel at rates measured on {gpu_type} ({kernels.source}): "
            f"GEMMs {low:.3g}-{high:.3g} TFLOP/s by size, attention "
            f"{kernels.rates.attention_tflops[-1][1]:.3g} TFLOP/s, memory "
            f"{kernels.rates.hbm_tbs * 1e3:.3g} GB/s"
        )
    rates = kernels.rates
    share = (rates.gemm.get(dtype) or rates.gemm["bf16"])[0]
    waves = f" over {rates.sms} SMs" if rates.sms else ""
    seq, attention = (
        rates.attention_tflops[-2] if len(rates.attention_tflops) > 1 else rates.attention_tflops[0]
    )
    return (
        f"compute kernel by kernel (launcher/plan/compute.py): each linear's three GEMMs at "
        f"their shapes on the rank, at {share:.0%} of {gpu_type}'s dense {dtype} peak "
        f"({kernels.peak.get(dtype, 0):g} TFLOP/s) less tile and wave quantization{waves}, or "
        f"memory-bound at {rates.hbm_tbs:g} TB/s; fused causal attention at "
        f"{attention:g} TFLOP/s ({seq} tokens; BF16); element-wise work, the loss and the "
        f"optimizer at {rates.hbm_tbs:g} TB/s; recomputation included"
    )
