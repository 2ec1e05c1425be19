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


# What every device of a vendor shares: its Ray resource, torch device type and collective backend.
_CPU = dict(vendor="generic", ray_resource=None, torch_device_type="cpu", collective_backend="gloo")
_NVIDIA = dict(vendor="nvidia", ray_resource="GPU", torch_device_type="cuda", collective_backend="nccl")
_HUAWEI = dict(vendor="huawei", ray_resource="NPU", torch_device_type="npu", collective_backend="hccl")


def _spec(name, platform, dies, bf16_tflops, int8_tops, hbm_gib, hbm_tb_per_s, **peaks) -> AcceleratorSpec:
    """One catalog row in the datasheets' units (TFLOPS, TOPS, GiB, TB/s); `peaks`: the optional fields."""
    return AcceleratorSpec(
        name=name,
        dies_per_chip=dies,
        bf16_flops_per_s=bf16_tflops * TERA,
        int8_ops_per_s=int8_tops * TERA,
        hbm_bytes=hbm_gib * GIB,
        hbm_bytes_per_s=hbm_tb_per_s * TERA,
        **platform,
        **peaks,
    )


# Source: NVIDIA H100 Tensor Core GPU datasheet, "H100 SXM" column, sparse figures halved.
_H100_SXM = _spec("h100", _NVIDIA, 1, 989, 1979, 80, 3.35, fp8_flops_per_s=1979 * TERA)

ACCELERATORS: dict[str, AcceleratorSpec] = {
    spec.name: spec
    for spec in (
        # cpu: order of magnitude for one AVX-512 core (2 FMA x 32 BF16 lanes x 2 flop at ~2.5 GHz);
        # not a hardware fact: `pdcluster profile` calibrates it against the live engine.
        _spec("cpu", _CPU, 1, 0.3, 0.6, 8, 0.01, fp32_flops_per_s=0.15 * TERA),
        # Ascend 910B3 (Atlas 800T A2): no Huawei datasheet; figures as widely reported, +-15%.
        _spec("ascend-910b", _HUAWEI, 1, 313, 626, 64, 1.6),
        # Ascend 910C per die (package halved). Source: Zuo et al., "Serving Large Language Models on
        # Huawei CloudMatrix384", arXiv:2506.12708, section on the Ascend 910C chip.
        _spec("ascend-910c", _HUAWEI, 2, 376, 752, 64, 1.6),
        _H100_SXM,
        # H800: H100 SXM compute, NVLink cut to 400 GB/s. Sources: NVIDIA H800 product brief;
        # DeepSeek-V3 report (arXiv:2412.19437) section 3.1.
        dataclasses.replace(_H100_SXM, name="h800"),
        # H200: H100 SXM compute with more and faster HBM. Source: NVIDIA H200 Tensor Core GPU datasheet,
        # "H200 SXM" column.
        dataclasses.replace(_H100_SXM, name="h200", hbm_bytes=141 * GIB, hbm_bytes_per_s=4.8 * TERA),
        # Source: NVIDIA A100 Tensor Core GPU datasheet, "A100 80GB SXM" column, sparse figures halved.
        _spec("a100", _NVIDIA, 1, 312, 624, 80, 2.039),
    )
}


def get_accelerator(name: str) -> AcceleratorSpec:
    """The catalog entry `name`; raises KeyError listing the known names."""
    try:
        return ACCELERATORS[name]
    except KeyError:
        raise KeyError(f"unknown accelerator {name!r}; known: {', '.join(ACCELERATORS)}") from None
