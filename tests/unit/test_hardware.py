"""The GPU table: names, device-name matching and peak FLOP/s."""

import pytest

from pretrain.core.hardware import (
    GPUS,
    gpu_spec,
    links,
    match_device_name,
    peak_tflops,
)

REQUIRED = [
    "h100_sxm",
    "h100_pcie",
    "h200_sxm",
    "a100_sxm_80gb",
    "a100_sxm_40gb",
    "a100_pcie_80gb",
    "a100_pcie_40gb",
    "b200",
    "b300",
    "h20",
    "gh200",
    "gh200_144gb",
    "mi300x",
    "mi325x",
    "l40s",
    "cpu",
]


def test_table_holds_every_required_accelerator():
    assert set(REQUIRED) <= set(GPUS)


@pytest.mark.parametrize(
    ("device_name", "expected"),
    [
        ("NVIDIA H100 80GB HBM3", "h100_sxm"),
        ("NVIDIA H100 PCIe", "h100_pcie"),
        ("NVIDIA H200", "h200_sxm"),
        ("NVIDIA A100-SXM4-80GB", "a100_sxm_80gb"),
        ("NVIDIA A100-SXM4-40GB", "a100_sxm_40gb"),
        ("NVIDIA A100 80GB PCIe", "a100_pcie_80gb"),
        ("NVIDIA B200", "b200"),
        ("NVIDIA B300 SXM6 AC", "b300"),
        ("NVIDIA H20", "h20"),
        ("NVIDIA GH200 480GB", "gh200"),
        ("NVIDIA GH200 144G HBM3e", "gh200_144gb"),
        ("NVIDIA A100-PCIE-40GB", "a100_pcie_40gb"),
        ("AMD Instinct MI300X", "mi300x"),
        ("AMD Instinct MI325X", "mi325x"),
        ("NVIDIA L40S", "l40s"),
        ("Tesla V100-SXM2-32GB", "v100_sxm_32gb"),
    ],
)
def test_cuda_device_names_match_their_table_entry(device_name, expected):
    assert match_device_name(device_name) == expected


@pytest.mark.parametrize(
    "device_name",
    ["NVIDIA H100 NVL", "NVIDIA H200 NVL", "Tesla T4", "AMD Instinct MI250X", ""],
)
def test_devices_whose_figures_differ_from_every_entry_match_nothing(device_name):
    assert match_device_name(device_name) is None


def test_unknown_gpu_type_error_lists_the_known_names():
    with pytest.raises(KeyError) as error:
        gpu_spec("h100")
    for name in REQUIRED:
        assert name in str(error.value)


@pytest.mark.parametrize("name", [n for n in REQUIRED if n != "cpu"])
def test_bf16_and_fp16_peaks_are_equal_and_twice_tf32(name):
    # Tensor cores run bf16 and fp16 at one rate and tf32 at half of it on every
    # generation since Ampere; a sparse figure pasted by mistake breaks the ratio to fp32.
    assert peak_tflops(name, "bf16") == peak_tflops(name, "fp16")
    assert peak_tflops(name, "tf32") == pytest.approx(peak_tflops(name, "bf16") / 2, rel=0.02)
    assert peak_tflops(name, "fp32") < peak_tflops(name, "tf32")


@pytest.mark.parametrize(
    "name", ["h100_sxm", "h100_pcie", "h200_sxm", "h20", "gh200", "b200", "b300", "mi300x", "l40s"]
)
def test_fp8_doubles_bf16_where_the_hardware_has_fp8(name):
    assert peak_tflops(name, "fp8") == pytest.approx(2 * peak_tflops(name, "bf16"), rel=0.02)


def test_ampere_has_no_fp8_peak_and_cpu_has_none_at_all():
    assert peak_tflops("a100_sxm_80gb", "fp8") is None
    assert all(peak_tflops("cpu", dtype) is None for dtype in ("fp32", "bf16", "fp8"))


def test_h200_computes_like_h100_sxm_with_more_memory():
    assert gpu_spec("h200_sxm").peak_tflops == gpu_spec("h100_sxm").peak_tflops
    assert gpu_spec("h200_sxm").memory_gib > gpu_spec("h100_sxm").memory_gib


def test_bf16_support_follows_compute_capability_8():
    supported = {name for name, spec in GPUS.items() if spec.supports_bf16}
    assert supported == set(GPUS) - {"v100_sxm_32gb"}
    assert all(
        ("bf16" in spec.peak_tflops) == spec.supports_bf16
        for spec in GPUS.values()
        if spec.name != "cpu"
    )


@pytest.mark.parametrize(
    ("name", "memory", "bf16", "fp8"),
    [
        # NVIDIA H20 product brief (HGX H20): 96 GB HBM3, 148 TFLOP/s BF16, 296 FP8 (dense).
        ("h20", 96, 148.0, 296.0),
        # NVIDIA GH200 datasheet: the H100-class GPU, 1,979 BF16 / 3,958 FP8 with sparsity.
        ("gh200", 96, 989.5, 1979.0),
        ("gh200_144gb", 144, 989.5, 1979.0),
        # NVIDIA HGX B300 datasheet: 36 PFLOP/s BF16 and 72 FP8 with sparsity over 8 GPUs,
        # 2.3 TB of HBM3e.
        ("b300", 288, 2250.0, 4500.0),
        # AMD Instinct MI300X / MI325X data sheets: 1,307.4 TFLOP/s BF16, 2,614.9 FP8 (dense).
        ("mi300x", 192, 1307.4, 2614.9),
        ("mi325x", 256, 1307.4, 2614.9),
        # NVIDIA A100 datasheet, PCIe 40 GB column: 312 BF16 (dense).
        ("a100_pcie_40gb", 40, 312.0, None),
    ],
)
def test_added_accelerators_carry_their_datasheet_figures(name, memory, bf16, fp8):
    spec = gpu_spec(name)
    assert spec.memory_gib == memory
    assert peak_tflops(name, "bf16") == bf16 and peak_tflops(name, "fp8") == fp8


def test_instinct_parts_report_rocm_capability_9_4_and_have_no_mxfp8():
    for name in ("mi300x", "mi325x"):
        assert gpu_spec(name).compute_capability == (9, 4)
    assert gpu_spec("b300").compute_capability >= (10, 0)
    assert all(links(name) is not None for name in GPUS if name != "cpu")
