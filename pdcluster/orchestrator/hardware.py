"""Accelerator catalog: what one device of each kind can do, from public material.

A *device* is what Ray and torch schedule as one unit: one GPU, one Ascend NPU die (each die of a dual-die
Ascend 910C is its own logical NPU device, the unit CloudMatrix-Infer assigns one expert to), or, for
`cpu`, one CPU worker slot. Every figure below is **per device** (per die for multi-die chips); multiply
by `dies_per_chip` for a package. Throughputs are dense peaks (no 2:4 sparsity). Capacities are binary
(GiB) because DRAM is, even where a datasheet writes "GB"; bandwidths are decimal (10^12 B/s = 1 TB/s).

The figures feed pre-flight checks (`orchestrator.topology`) and the planner's performance model; they are
peaks from vendors and papers, not measurements, and the planner calibrates against the live engine.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

GIB = 1024**3
TERA = 10**12


@dataclass(frozen=True)
class AcceleratorSpec:
    """One accelerator kind.

    Attributes:
        name: catalog key, as written in a topology's `hardware.accelerator`.
        vendor: `generic`, `huawei` or `nvidia`.
        dies_per_chip: dies in one package; each die is one logical device (figures are per die).
        bf16_flops_per_s: dense BF16 matrix peak of one device.
        int8_ops_per_s: dense INT8 matrix peak of one device.
        hbm_bytes: device memory of one device (host memory budget per worker for `cpu`).
        hbm_bytes_per_s: device memory bandwidth of one device.
        ray_resource: the Ray resource one device consumes (`GPU`, `NPU`); None for `cpu`, whose devices
            are CPU-only bundles.
        torch_device_type: `cpu`, `npu` (torch_npu) or `cuda`.
        collective_backend: torch.distributed backend between devices: `gloo`, `hccl` or `nccl`.
        fp8_flops_per_s: dense FP8 matrix peak; None where the device has no FP8 matrix unit.
        fp32_flops_per_s: dense FP32 matrix peak (what the engine's float32 weights run at on `cpu`);
            None where the catalog has no figure.
    """

    name: str
    vendor: str
    dies_per_chip: int
    bf16_flops_per_s: float
    int8_ops_per_s: float
    hbm_bytes: int
    hbm_bytes_per_s: float
    ray_resource: str | None
    torch_device_type: str
    collective_backend: str
    fp8_flops_per_s: float | None = None
    fp32_flops_per_s: float | None = None

    def matmul_flops_per_s(self, dtype: str) -> float:
        """Dense matrix peak for operands of `dtype` (`bfloat16`/`float16`, `int8`, `fp8`, `float32`).

        Raises:
            ValueError: the catalog has no peak for `dtype` on this device.
        """
        peak = {
            "bfloat16": self.bf16_flops_per_s,
            "float16": self.bf16_flops_per_s,
            "int8": self.int8_ops_per_s,
            "fp8": self.fp8_flops_per_s,
            "float32": self.fp32_flops_per_s,
        }.get(dtype)
        if peak is None:
            raise ValueError(f"accelerator {self.name!r} has no {dtype} matrix peak in the catalog")
        return peak

    @property
    def is_accelerator(self) -> bool:
        """False for `cpu` (no device resource in Ray; tensors live in host memory)."""
        return self.ray_resource is not None

    @property
    def hbm_bytes_per_chip(self) -> int:
        """Device memory of one package (all its dies)."""
        return self.hbm_bytes * self.dies_per_chip


# H100 SXM5 80GB: 989 TFLOPS BF16 dense (1,979 with sparsity), 1,979 TOPS INT8 dense, 80 GB HBM3 at
# 3.35 TB/s. Source: NVIDIA H100 Tensor Core GPU datasheet (table "H100 SXM"; its sparse figures
# halved).
_H100_SXM = AcceleratorSpec(
    name="h100",
    vendor="nvidia",
    dies_per_chip=1,
    bf16_flops_per_s=989 * TERA,
    int8_ops_per_s=1979 * TERA,
    hbm_bytes=80 * GIB,
    hbm_bytes_per_s=3.35 * TERA,
    ray_resource="GPU",
    torch_device_type="cuda",
    collective_backend="nccl",
    fp8_flops_per_s=1979 * TERA,
)


ACCELERATORS: dict[str, AcceleratorSpec] = {
    spec.name: spec
    for spec in (
        # cpu: rough order of magnitude for one x86 core (AVX-512 BF16/VNNI at ~2.5 GHz: 2 FMA units x
        # 32 BF16 lanes x 2 flop ~= 0.3 TFLOPS; VNNI INT8 about twice that) and its share of DDR bandwidth
        # (~10 GB/s). Not a hardware fact: one "device" is one CPU worker slot; the memory is the budget we
        # give a worker. The planner calibrates these against the live engine.
        AcceleratorSpec(
            name="cpu",
            vendor="generic",
            dies_per_chip=1,
            bf16_flops_per_s=0.3 * TERA,
            int8_ops_per_s=0.6 * TERA,
            hbm_bytes=8 * GIB,
            hbm_bytes_per_s=10e9,
            ray_resource=None,
            torch_device_type="cpu",
            collective_backend="gloo",
            fp32_flops_per_s=0.15 * TERA,  # AVX-512 FP32: half the BF16 lanes
        ),
        # Ascend 910B (910B3 SKU, Atlas 800T A2): ~313 TFLOPS FP16/BF16, 2x that in INT8, 64 GB HBM2e at
        # ~1.6 TB/s. Huawei publishes no single datasheet; these are the figures widely reported for the
        # SKU (product pages of Atlas 800T A2 resellers, benchmark papers); treat them as +-15%.
        AcceleratorSpec(
            name="ascend-910b",
            vendor="huawei",
            dies_per_chip=1,
            bf16_flops_per_s=313 * TERA,
            int8_ops_per_s=626 * TERA,
            hbm_bytes=64 * GIB,
            hbm_bytes_per_s=1.6 * TERA,
            ray_resource="NPU",
            torch_device_type="npu",
            collective_backend="hccl",
        ),
        # Ascend 910C, per die (2 dies per package): ~376 TFLOPS BF16, ~752 TOPS INT8, 64 GB HBM at
        # 1.6 TB/s. Source: Zuo et al., "Serving Large Language Models on Huawei CloudMatrix384",
        # arXiv:2506.12708 (2025), section on the Ascend 910C chip (package: 752 TFLOPS BF16, 128 GB,
        # 3.2 TB/s); the project's design notes ("Facts worth having at hand") quote the same.
        AcceleratorSpec(
            name="ascend-910c",
            vendor="huawei",
            dies_per_chip=2,
            bf16_flops_per_s=376 * TERA,
            int8_ops_per_s=752 * TERA,
            hbm_bytes=64 * GIB,
            hbm_bytes_per_s=1.6 * TERA,
            ray_resource="NPU",
            torch_device_type="npu",
            collective_backend="hccl",
        ),
        _H100_SXM,
        # H800 SXM5 80GB: the H100 SXM5 compute die for the Chinese market (989 TFLOPS BF16, 1,979 TFLOPS
        # FP8 dense, 80 GB HBM3 at 3.35 TB/s) with NVLink cut to 400 GB/s bidirectional (~160 GB/s
        # measured one way by DeepEP); 8 per node, one 400 Gb/s CX7 InfiniBand NIC per GPU. Sources: NVIDIA
        # H800 product brief; DeepSeek-V3 technical report (arXiv:2412.19437) section 3.1; DeepEP README.
        dataclasses.replace(_H100_SXM, name="h800"),
        # H200 SXM 141GB: same Hopper compute as H100 SXM (989 TFLOPS BF16, 1,979 TOPS INT8, dense),
        # 141 GB HBM3e at 4.8 TB/s. Source: NVIDIA H200 Tensor Core GPU datasheet ("H200 SXM" column).
        AcceleratorSpec(
            name="h200",
            vendor="nvidia",
            dies_per_chip=1,
            bf16_flops_per_s=989 * TERA,
            int8_ops_per_s=1979 * TERA,
            hbm_bytes=141 * GIB,
            hbm_bytes_per_s=4.8 * TERA,
            ray_resource="GPU",
            torch_device_type="cuda",
            collective_backend="nccl",
            fp8_flops_per_s=1979 * TERA,
        ),
        # A100 SXM4 80GB: 312 TFLOPS BF16 dense, 624 TOPS INT8 dense, 80 GB HBM2e at 2,039 GB/s.
        # Source: NVIDIA A100 Tensor Core GPU datasheet ("A100 80GB SXM" column, sparse figures halved).
        AcceleratorSpec(
            name="a100",
            vendor="nvidia",
            dies_per_chip=1,
            bf16_flops_per_s=312 * TERA,
            int8_ops_per_s=624 * TERA,
            hbm_bytes=80 * GIB,
            hbm_bytes_per_s=2.039 * TERA,
            ray_resource="GPU",
            torch_device_type="cuda",
            collective_backend="nccl",
        ),
    )
}


def get_accelerator(name: str) -> AcceleratorSpec:
    """The catalog entry `name`; raises KeyError listing the known names."""
    try:
        return ACCELERATORS[name]
    except KeyError:
        raise KeyError(f"unknown accelerator {name!r}; known: {', '.join(ACCELERATORS)}") from None
