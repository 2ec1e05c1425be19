"""Accelerator catalog: what one device of each kind can do, from public datasheets and papers.

A device is one GPU, one Ascend die, or for `cpu` one worker slot; figures are per device, dense peaks,
capacities in GiB and bandwidths in decimal bytes/s.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

GIB = 1024**3
TERA = 10**12


@dataclass(frozen=True)
class AcceleratorSpec:
    """One accelerator kind; `*_flops_per_s` are dense matrix peaks per device (None: no unit or no figure).
    `hbm_bytes` is a worker's memory budget and `ray_resource` None for `cpu`."""

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
        """Dense matrix peak for operands of `dtype`; ValueError where the catalog has none."""
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
        """False for `cpu` (no device resource in Ray)."""
        return self.ray_resource is not None

    @property
    def hbm_bytes_per_chip(self) -> int:
        """Device memory of one package (all its dies)."""
        return self.hbm_bytes * self.dies_per_chip


# Source: NVIDIA H100 Tensor Core GPU datasheet, "H100 SXM" column, sparse figures halved.
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
        # cpu: order of magnitude for one AVX-512 core (2 FMA x 32 BF16 lanes x 2 flop at ~2.5 GHz);
        # not a hardware fact: `pdcluster profile` calibrates it against the live engine.
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
            fp32_flops_per_s=0.15 * TERA,
        ),
        # Ascend 910B3 (Atlas 800T A2): no Huawei datasheet; figures as widely reported, +-15%.
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
        # Ascend 910C per die (package halved). Source: Zuo et al., "Serving Large Language Models on
        # Huawei CloudMatrix384", arXiv:2506.12708, section on the Ascend 910C chip.
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
        # H800: H100 SXM compute, NVLink cut to 400 GB/s. Sources: NVIDIA H800 product brief;
        # DeepSeek-V3 report (arXiv:2412.19437) section 3.1.
        dataclasses.replace(_H100_SXM, name="h800"),
        # Source: NVIDIA H200 Tensor Core GPU datasheet, "H200 SXM" column.
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
        # Source: NVIDIA A100 Tensor Core GPU datasheet, "A100 80GB SXM" column, sparse figures halved.
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
