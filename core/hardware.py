"""A table of known accelerators: memory, dense peak TFLOP/s per dtype, compute capability.

Peaks are dense (without 2:4 structured sparsity), per device, from the vendors' datasheets:
NVIDIA H100 Tensor Core GPU datasheet (SXM5 and PCIe columns), NVIDIA H200 Tensor Core GPU
datasheet (SXM column), NVIDIA H20 product brief (HGX H20, 2024), NVIDIA GH200 Grace Hopper
Superchip datasheet (the 96 GB HBM3 and 144 GB HBM3e versions), NVIDIA A100 Tensor Core GPU
datasheet (SXM4/PCIe, 40 and 80 GB columns), NVIDIA DGX B200 / HGX B200 and HGX B300
datasheets (8-GPU system figures divided by 8), NVIDIA L40S datasheet, the NVIDIA V100
datasheet (SXM2), and the AMD Instinct MI300X and MI325X data sheets. NVIDIA's datasheets
quote tensor-core figures "with sparsity"; the dense figure is half of that (AMD's tables
give dense figures). `fp32` is the plain (non-tensor-core) FP32 rate; on the Instinct parts
FP32 matrix and vector peaks are the same.

Memory is the nominal capacity in GiB; CUDA reports slightly less as usable. The Instinct
parts run PyTorch through ROCm, which reports their ISA (gfx942) as compute capability 9.4.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

GIB = 2**30
"""Bytes in a GiB: the unit device memory, plans and measurements are reported in."""


@dataclass(frozen=True)
class GpuSpec:
    """One accelerator model as the planner and the metrics see it."""

    name: str
    memory_gib: float
    """Nominal device memory; 0 for `cpu` (the planner does not compare against it)."""
    peak_tflops: dict[str, float] = field(default_factory=dict)
    """Dense peak TFLOP/s by compute dtype; a dtype missing here is not supported."""
    compute_capability: tuple[int, int] = (0, 0)

    @property
    def supports_bf16(self) -> bool:
        """Whether the device computes in bf16 (compute capability 8.0 and newer; any CPU)."""
        return self.name == "cpu" or self.compute_capability >= (8, 0)


_HOPPER_SXM = {"fp8": 1979.0, "bf16": 989.5, "fp16": 989.5, "tf32": 494.5, "fp32": 67.0}
_AMPERE = {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}
_BLACKWELL = {"fp8": 4500.0, "bf16": 2250.0, "fp16": 2250.0, "tf32": 1125.0, "fp32": 75.0}
_CDNA3 = {"fp8": 2614.9, "bf16": 1307.4, "fp16": 1307.4, "tf32": 653.7, "fp32": 163.4}

GPUS: dict[str, GpuSpec] = {
    spec.name: spec
    for spec in (
        GpuSpec("h100_sxm", 80, dict(_HOPPER_SXM), (9, 0)),
        GpuSpec(
            "h100_pcie",
            80,
            {"fp8": 1513.0, "bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.0},
            (9, 0),
        ),
        # The H200 has the H100 SXM's compute with more and faster memory.
        GpuSpec("h200_sxm", 141, dict(_HOPPER_SXM), (9, 0)),
        # A Hopper with its tensor cores cut to 15% of the H100's, and 96 GB of HBM3.
        GpuSpec(
            "h20",
            96,
            {"fp8": 296.0, "bf16": 148.0, "fp16": 148.0, "tf32": 74.0, "fp32": 44.0},
            (9, 0),
        ),
        # The Grace Hopper superchip's GPU computes like the H100 SXM.
        GpuSpec("gh200", 96, dict(_HOPPER_SXM), (9, 0)),
        # The H800 SXM: the H100 SXM's compute and memory with NVLink cut to 400 GB/s.
        GpuSpec("h800", 80, dict(_HOPPER_SXM), (9, 0)),
        GpuSpec("gh200_144gb", 144, dict(_HOPPER_SXM), (9, 0)),
        GpuSpec("a100_sxm_80gb", 80, dict(_AMPERE), (8, 0)),
        GpuSpec("a100_sxm_40gb", 40, dict(_AMPERE), (8, 0)),
        GpuSpec("a100_pcie_80gb", 80, dict(_AMPERE), (8, 0)),
        GpuSpec("a100_pcie_40gb", 40, dict(_AMPERE), (8, 0)),
        GpuSpec("b200", 180, dict(_BLACKWELL), (10, 0)),
        # Blackwell Ultra: B200's dense FP8 and BF16 rates (its gains are FP4), 288 GB.
        GpuSpec("b300", 288, dict(_BLACKWELL), (10, 3)),
        GpuSpec("mi300x", 192, dict(_CDNA3), (9, 4)),
        # The MI300X's compute with 256 GB of HBM3E.
        GpuSpec("mi325x", 256, dict(_CDNA3), (9, 4)),
        GpuSpec(
            "l40s",
            48,
            {"fp8": 733.0, "bf16": 362.05, "fp16": 362.05, "tf32": 183.0, "fp32": 91.6},
            (8, 9),
        ),
        # Volta has no bf16 and no tf32: kept so that bf16 on it is refused by name.
        GpuSpec("v100_sxm_32gb", 32, {"fp16": 125.0, "fp32": 15.7}, (7, 0)),
        # Ranks on CPU: no table peak (the metrics measure one), no device memory to fit.
        GpuSpec("cpu", 0, {}, (0, 0)),
    )
}

# Patterns over torch.cuda.get_device_name(), first match wins; the NVL parts differ in
# clocks or memory from every entry above, so they match nothing.
_DEVICE_NAME_PATTERNS: tuple[tuple[str, str], ...] = (
    (r"\bH100\b.*\b(PCIE)\b", "h100_pcie"),
    (r"^(NVIDIA )?H100\b(?!.*\bNVL\b)", "h100_sxm"),
    (r"^(NVIDIA )?H200\b(?!.*\bNVL\b)", "h200_sxm"),
    (r"^(NVIDIA )?H20\b", "h20"),
    (r"^(NVIDIA )?H800\b(?!.*\bNVL\b)", "h800"),
    (r"^(NVIDIA )?GH200\b.*\b144G", "gh200_144gb"),
    (r"^(NVIDIA )?GH200\b", "gh200"),
    (r"\bA100-SXM4?-80GB\b", "a100_sxm_80gb"),
    (r"\bA100-SXM4?-40GB\b", "a100_sxm_40gb"),
    (r"\bA100\b.*80GB.*\bPCIE\b|\bA100-PCIE-80GB\b", "a100_pcie_80gb"),
    (r"\bA100-PCIE-40GB\b", "a100_pcie_40gb"),
    (r"^(NVIDIA )?B200\b", "b200"),
    (r"^(NVIDIA )?B300\b", "b300"),
    (r"\bMI300X\b", "mi300x"),
    (r"\bMI325X\b", "mi325x"),
    (r"^(NVIDIA )?L40S\b", "l40s"),
    (r"\bV100-SXM2-32GB\b", "v100_sxm_32gb"),
)


def gpu_spec(name: str) -> GpuSpec:
    """The table entry for `name`; a KeyError lists the known names if there is none."""
    try:
        return GPUS[name]
    except KeyError:
        raise KeyError(f"unknown GPU type {name!r}; known: {', '.join(GPUS)}") from None


def match_device_name(cuda_device_name: str) -> str | None:
    """The table name for a CUDA device name ("NVIDIA H100 80GB HBM3" -> "h100_sxm")."""
    text = " ".join(cuda_device_name.upper().split())
    for pattern, name in _DEVICE_NAME_PATTERNS:
        if re.search(pattern, text):
            return name
    return None


def peak_tflops(name: str, dtype: str) -> float | None:
    """Dense peak TFLOP/s of `name` for `dtype`, or None where the table has no figure."""
    return gpu_spec(name).peak_tflops.get(dtype)


@dataclass(frozen=True)
class Links:
    """Per-GPU link bandwidths the layout search's cost model uses, in GB/s per direction."""

    intra_node_gbs: float
    """NVLink (or PCIe where a node has no NVLink switch) from one GPU to its node's peers."""
    inter_node_gbs: float
    """InfiniBand from one GPU to other nodes: the reference system's NICs divided by its GPUs."""
    intra_node_latency_us: float = 2.0
    """Seconds (in us) one step of a collective or one send costs inside a node, whatever
    its size: NCCL's LL-protocol hop over NVLink is 1-2 us (nccl-tests on DGX H100: an
    8-byte all-reduce over 8 GPUs, 14 ring steps, takes about 20 us)."""
    inter_node_latency_us: float = 5.0
    """The same between nodes: an InfiniBand NDR/HDR send through one switch level plus the
    NIC and proxy thread (NCCL's base latency for the IB transport, about 5 us)."""


# NVLink: the datasheets' total NVLink bandwidth per GPU is bidirectional; half of it flows
# each way (H100/H200/H20/GH200 900 GB/s, A100 SXM 600, B200/B300 1800, V100 SXM2 300).
# AMD Infinity Fabric: 7 links of 128 GB/s (bidirectional) to the node's other GPUs, 448
# GB/s each way. PCIe cards without an NVLink switch talk over PCIe x16 (Gen5 64 GB/s, Gen4
# 32 GB/s each way).
# Between nodes: DGX H100/H200 and DGX B200 have one 400 Gb/s ConnectX-7 per GPU (50 GB/s),
# HGX B300 one 800 Gb/s ConnectX-8 (100 GB/s), DGX A100 one 200 Gb/s HDR per GPU (25 GB/s),
# DGX-2 (V100) one 100 Gb/s EDR per GPU; GH200 systems (Alps, JUPITER) one 200 Gb/s
# Slingshot or NDR200 port per superchip; H20 and Instinct servers are taken with one
# 400 Gb/s NIC per GPU and PCIe servers with one 200 Gb/s NIC per GPU.
LINKS: dict[str, Links] = {
    "h100_sxm": Links(450.0, 50.0),
    "h100_pcie": Links(64.0, 25.0),
    "h200_sxm": Links(450.0, 50.0),
    "a100_sxm_80gb": Links(300.0, 25.0),
    "a100_sxm_40gb": Links(300.0, 25.0),
    "a100_pcie_80gb": Links(32.0, 25.0),
    "h20": Links(450.0, 50.0),
    # H800 SXM: 400 GB/s of NVLink (bidirectional; the H100's 900), one 400 Gb/s NIC per
    # GPU (DeepSeek-V3 technical report, section 3.2.2: 160 GB/s of NVLink reached, IB
    # 50 GB/s).
    "h800": Links(200.0, 50.0),
    "gh200": Links(450.0, 25.0),
    "gh200_144gb": Links(450.0, 25.0),
    "a100_pcie_40gb": Links(32.0, 25.0),
    "b200": Links(900.0, 50.0),
    "b300": Links(900.0, 100.0),
    "mi300x": Links(448.0, 50.0),
    "mi325x": Links(448.0, 50.0),
    "l40s": Links(32.0, 25.0),
    "v100_sxm_32gb": Links(150.0, 12.5),
}


def links(name: str) -> Links | None:
    """Link bandwidths of GPU `name`, or None where the table has none (e.g. `cpu`)."""
    return LINKS.get(name)


def with_overrides(table: Links, stated: dict[str, float]) -> Links:
    """`table` with the user's stated figures (`hardware.*` fields; 0 keeps the table's)."""
    chosen = {name: value for name, value in stated.items() if value > 0}
    return replace(table, **chosen)


@dataclass(frozen=True)
class KernelRates:
    """How fast one accelerator runs the kernels of a training step, for the cost model's
    compute term (`pretrain.launcher.plan.compute`)."""

    sms: int | None
    """Streaming multiprocessors: the tiles one wave of a GEMM runs (None where no count was
    read: every GEMM is taken to fill the device)."""
    hbm_tbs: float
    """Peak memory bandwidth, TB/s: the rate of element-wise work, norms and the optimizer."""
    gemm: dict[str, tuple[float, tuple[int, int, int]]]
    """By dtype, the share of the dense peak a GEMM of the best shape found reaches (the
    Maximum Achievable Matmul FLOPS over the datasheet peak) and that shape (M, N, K); bf16's
    serves fp16, tf32 and fp32."""
    attention_tflops: tuple[tuple[float, float], ...]
    """(sequence length, TFLOP/s) of fused causal attention, forward and backward together,
    head dim 128, counted as FlashAttention's benchmarks count them (the causal half of the
    square; backward 2.5 times the forward)."""


# GEMMs: S. Bekman, "Machine Learning Engineering", compute/accelerator/README.md, "Maximum
# Achievable Matmul FLOPS comparison table" (mamf-finder.py, mean of 100 iterations at the
# best shape, MxNxK): BF16 A100 SXM 271.2 of 312 (86.9%), H100 SXM 794.5 of 989 (80.3%; "H200 is
# the same"), GH200 828.6 (83.8%), B200 1745 of 2250 (77.6%), B300 1769 (78.6%), MI300X
# 668.4 of 1300 (51.4%), MI325X 784.9 (60.4%), A100 PCIe 252.9 (81.1%); FP8 H100 SXM 1402.6
# of 1979 (70.9%), H200 1453.4 (73.4%), GH200 1535 (77.6%), B200 3432.5 of 4500 (76.3%),
# B300 3353.3 (74.5%). Parts without a measurement take their architecture's: the H800, H20
# and H100 PCIe the H100 SXM's shares, the A100 40 GB the A100 SXM's, the L40S (Ada, no
# published MAMF) the A100 SXM's.
# SMs: 108 on A100, 132 on H100/H200 (the same book, training/performance/README.md, "Tile
# and wave quantization"), 148 on B300 ("Do more SMs give more TFLOPS?"), 142 on the L40S
# (NVIDIA L40S datasheet); the H800 and GH200 are H100 dies; no count for the others.
# Memory: the same book's "Accelerator memory" table (TB/s): H100 SXM 3.35, H200 4.8, GH200
# 4.0 (96 GB) and 4.8 (144 GB), A100 SXM 80 GB 2.0, A100 PCIe 80 GB 1.94, H100 PCIe 2.0, B200
# and B300 8.0, MI300X 5.3, MI325X 6.0; A100 40 GB 1.555 (NVIDIA A100 datasheet), H20 4.0
# (NVIDIA H20 product brief), L40S 0.864 (NVIDIA L40S datasheet), H800 the H100 SXM's.
# Attention: FlashAttention-2 (the kernel PyTorch's scaled_dot_product_attention runs on
# Ampere and Hopper), Dao-AILab/flash-attention README, "Attention forward + backward speed",
# with causal mask, head dimension 128 (assets/flash2_a100_fwd_bwd_benchmark.png, A100 80GB
# SXM4; assets/flash2_h100_fwd_bwd_benchmark.png, H100 80GB SXM5). Other parts take the
# Hopper figures scaled by their BF16 peak over the H100's.
_A100_ATTENTION = (
    (512, 99.0), (1024, 133.0), (2048, 155.0), (4096, 173.0), (8192, 182.0), (16384, 189.0)
)  # fmt: skip
_H100_ATTENTION = (
    (512, 163.0), (1024, 221.0), (2048, 265.0), (4096, 294.0), (8192, 308.0), (16384, 328.0)
)  # fmt: skip
_H100_GEMM = {"bf16": (0.803, (2048, 2048, 13312)), "fp8": (0.709, (1024, 9216, 14336))}
_A100_GEMM = {"bf16": (0.869, (1024, 10240, 5120))}
_GH200_GEMM = {"bf16": (0.838, (1024, 15360, 4096)), "fp8": (0.776, (1024, 14336, 14336))}


def _scaled(
    figures: tuple[tuple[float, float], ...], bf16_peak: float
) -> tuple[tuple[float, float], ...]:
    return tuple((seq, tflops * bf16_peak / _HOPPER_SXM["bf16"]) for seq, tflops in figures)


KERNELS: dict[str, KernelRates] = {
    "h100_sxm": KernelRates(132, 3.35, dict(_H100_GEMM), _H100_ATTENTION),
    "h100_pcie": KernelRates(None, 2.0, dict(_H100_GEMM), _scaled(_H100_ATTENTION, 756.0)),
    "h200_sxm": KernelRates(
        132, 4.8, {**_H100_GEMM, "fp8": (0.734, (1280, 4096, 12032))}, _H100_ATTENTION
    ),
    "h800": KernelRates(132, 3.35, dict(_H100_GEMM), _H100_ATTENTION),
    "h20": KernelRates(None, 4.0, dict(_H100_GEMM), _scaled(_H100_ATTENTION, 148.0)),
    "gh200": KernelRates(132, 4.0, dict(_GH200_GEMM), _H100_ATTENTION),
    "gh200_144gb": KernelRates(132, 4.8, dict(_GH200_GEMM), _H100_ATTENTION),
    "a100_sxm_80gb": KernelRates(108, 2.0, dict(_A100_GEMM), _A100_ATTENTION),
    "a100_sxm_40gb": KernelRates(108, 1.555, dict(_A100_GEMM), _A100_ATTENTION),
    "a100_pcie_80gb": KernelRates(
        108, 1.94, {"bf16": (0.811, (2048, 5120, 6144))}, _A100_ATTENTION
    ),
    "a100_pcie_40gb": KernelRates(
        108, 1.555, {"bf16": (0.811, (2048, 5120, 6144))}, _A100_ATTENTION
    ),
    "b200": KernelRates(
        None,
        8.0,
        {"bf16": (0.776, (1792, 16128, 3072)), "fp8": (0.763, (15360, 4096, 3072))},
        _scaled(_H100_ATTENTION, 2250.0),
    ),
    "b300": KernelRates(
        148,
        8.0,
        {"bf16": (0.786, (12288, 18432, 1024)), "fp8": (0.745, (3072, 6144, 7168))},
        _scaled(_H100_ATTENTION, 2250.0),
    ),
    "mi300x": KernelRates(
        None, 5.3, {"bf16": (0.514, (10240, 15360, 8192))}, _scaled(_H100_ATTENTION, 1307.4)
    ),
    "mi325x": KernelRates(
        None, 6.0, {"bf16": (0.604, (13312, 10240, 8192))}, _scaled(_H100_ATTENTION, 1307.4)
    ),
    "l40s": KernelRates(142, 0.864, dict(_A100_GEMM), _scaled(_H100_ATTENTION, 362.05)),
}


def kernel_rates(name: str) -> KernelRates | None:
    """The kernel rates of GPU `name`, or None where the table has none (V100, `cpu`)."""
    return KERNELS.get(name)


FLASH_HEAD_DIMS = range(8, 257, 8)
"""Head dims CUDA's FlashAttention-2 kernel runs (multiples of 8 up to 256)."""


def fused_ring_attention(device: str, half_precision: bool, head_dim: int, masked: bool) -> bool:
    """Whether context parallelism's ring runs the device's fused flash attention on its
    chunk pairs (parallel/ring_attention.py), the planner's memory model asking the same:
    never under a document mask (FlashAttention takes none); on a CPU always (its flash
    kernel, in FP32); on CUDA in half precision with a head dim FlashAttention-2 runs."""
    if masked:
        return False
    if device == "cpu":
        return True
    return device == "cuda" and half_precision and head_dim in FLASH_HEAD_DIMS
