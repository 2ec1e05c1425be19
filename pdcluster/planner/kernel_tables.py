"""Published kernel measurements the planner prices ops with, each table with its `source`.

GEMMs by shape and layout (`dense`, `contiguous`, `masked`): `max(2 M N K / F, bytes / B)` with F, B from the
rows of nearest `(N, K)`, interpolated in `log M`; MLA attention fractions by sequence length; EP
dispatch/combine bandwidth by EP size. Stored as fractions of the measuring device's peak.
"""

from __future__ import annotations

import bisect
import functools
import math
from dataclasses import dataclass

TERA, GIGA = 1e12, 1e9
H800_FP8_FLOPS, H800_HBM_BYTES_PER_S = 1979 * TERA, 3.35 * TERA
DEEPGEMM = (
    "DeepGEMM README, 'Performance' tables (github.com/deepseek-ai/DeepGEMM at 327ec92, 2025-04-09): FP8 "
    "GEMMs of DeepSeek-V3/R1 inference shapes on H800 SXM5, NVCC 12.8"
)


@dataclass(frozen=True)
class GemmPoint:
    """One measured GEMM: `m` rows per group, `n`, `k`; achieved `flops_per_s` and `bytes_per_s`."""

    m: int
    n: int
    k: int
    flops_per_s: float
    bytes_per_s: float


@dataclass(frozen=True)
class GemmTable:
    """Measured GEMMs of one layout on one device kind, as fractions of its peaks."""

    layout: str
    points: tuple[GemmPoint, ...]
    peak_flops_per_s: float
    peak_bytes_per_s: float
    source: str

    def fractions(self, m: float, n: int, k: int) -> tuple[float, float]:
        """`(compute fraction, memory fraction)` of a GEMM of `m` rows (per group) and shape `(n, k)`."""
        ms, flops, b = _curve(self, n, k)
        return interpolate_log(ms, flops, m) / self.peak_flops_per_s, b / self.peak_bytes_per_s

    @property
    def min_m(self) -> int:
        return min(p.m for p in self.points)


@functools.lru_cache(maxsize=1024)
def _curve(table: GemmTable, n: int, k: int) -> tuple[list[float], list[float], float]:
    """The rows whose `(n, k)` is nearest `(n, k)` in log distance: `(m, FLOP/s, best bytes/s)`."""
    shapes = {(p.n, p.k) for p in table.points}
    near = min(sorted(shapes), key=lambda s: abs(math.log(s[0] / n)) + abs(math.log(s[1] / k)))
    rows = sorted((p for p in table.points if (p.n, p.k) == near), key=lambda p: p.m)
    return [p.m for p in rows], [p.flops_per_s for p in rows], max(p.bytes_per_s for p in rows)


def interpolate_log(xs, ys, x: float) -> float:
    """`ys` at `x`, linear in `log x` between the points `xs` (ascending), held at the ends."""
    i = bisect.bisect_left(xs, x)
    if i == 0:
        return ys[0]
    if i == len(xs):
        return ys[-1]
    w = math.log(x / xs[i - 1]) / math.log(xs[i] / xs[i - 1])
    return ys[i - 1] + w * (ys[i] - ys[i - 1])


def _points(rows: tuple[tuple[int, int, int, float, float], ...]) -> tuple[GemmPoint, ...]:
    return tuple(GemmPoint(m, n, k, tf * TERA, gb * GIGA) for m, n, k, tf, gb in rows)


# (M per group, N, K, TFLOPS, GB/s) as the DeepGEMM README prints them.
HOPPER_GEMM = {
    "dense": GemmTable("dense", _points((
        (64, 2112, 7168, 206, 1688), (64, 24576, 1536, 289, 2455), (64, 32768, 512, 219, 2143),
        (64, 7168, 16384, 336, 2668), (64, 4096, 7168, 287, 2320), (64, 7168, 2048, 295, 2470),
        (128, 2112, 7168, 352, 1509), (128, 24576, 1536, 535, 2448), (128, 32768, 512, 358, 2103),
        (128, 7168, 16384, 645, 2604), (128, 4096, 7168, 533, 2221), (128, 7168, 2048, 510, 2277),
        (4096, 2112, 7168, 1127, 562), (4096, 24576, 1536, 1212, 962), (4096, 32768, 512, 775, 1620),
        (4096, 7168, 16384, 1520, 384), (4096, 4096, 7168, 1410, 541), (4096, 7168, 2048, 1168, 794),
    )), H800_FP8_FLOPS, H800_HBM_BYTES_PER_S, f"{DEEPGEMM}, 'Normal GEMMs for dense models'"),
    "contiguous": GemmTable("contiguous", _points((
        (8192, 4096, 7168, 1346, 434), (8192, 7168, 2048, 1214, 752),
        (4096, 4096, 7168, 1346, 516), (4096, 7168, 2048, 1214, 826),
    )), H800_FP8_FLOPS, H800_HBM_BYTES_PER_S,
        f"{DEEPGEMM}, 'Grouped GEMMs for MoE models (contiguous layout)'"),
    "masked": GemmTable("masked", _points((
        (1024, 4096, 7168, 1233, 924), (1024, 7168, 2048, 925, 968),
        (512, 4096, 7168, 1040, 1288), (512, 7168, 2048, 916, 1405),
        (256, 4096, 7168, 932, 2064), (256, 7168, 2048, 815, 2047),
    )), H800_FP8_FLOPS, H800_HBM_BYTES_PER_S, f"{DEEPGEMM}, 'Grouped GEMMs for MoE models (masked layout)'"),
}  # fmt: skip

CM_INFER = "Zuo et al., 'Serving Large Language Models on Huawei CloudMatrix384', arXiv:2506.12708 (2025)"
ASCEND_910C_INT8_OPS, ASCEND_910C_HBM_BYTES_PER_S = 752 * TERA, 1.6 * TERA
# CM-Infer (arXiv:2506.12708): INT8 GEMMs at 77-83% of peak (80% here); small-M bandwidth from DeepGEMM.
_ASCEND_BW = 2668 / 3350 * ASCEND_910C_HBM_BYTES_PER_S / GIGA
ASCEND_GEMM = {
    layout: GemmTable(
        layout,
        _points(((4096, 7168, 2048, 0.80 * 752, _ASCEND_BW),)),
        ASCEND_910C_INT8_OPS,
        ASCEND_910C_HBM_BYTES_PER_S,
        f"{CM_INFER}: INT8 GEMM 77-83% of peak (80% used); bandwidth fraction borrowed from {DEEPGEMM}",
    )
    for layout in ("dense", "contiguous", "masked")
}


@dataclass(frozen=True)
class AttentionTable:
    """MLA compute fraction of the BF16 peak by sequence length; `memory_fraction` for decode."""

    seq_lens: tuple[int, ...]
    compute_fractions: tuple[float, ...]
    decode_compute_fraction: float
    memory_fraction: float
    source: str

    def prefill_compute_fraction(self, seq_len: float) -> float:
        return interpolate_log(self.seq_lens, self.compute_fractions, seq_len)


_FA3_TFLOPS = (430.32, 517.099, 565.544, 590.233, 614.234, 620.73)
_FA3_LENS = (512, 1024, 2048, 4096, 8192, 16384)
_FA3 = (
    "FlashAttention-3 BF16 forward, head dim 128, batch x length = 16K, on H100 SXM5 (pytorch/benchmark "
    "commit ff65cb6, 'flash_v3-tflops' at 512..16K), as fractions of 989 TFLOPS"
)
HOPPER_ATTENTION = AttentionTable(
    _FA3_LENS,
    tuple(tf / 989 for tf in _FA3_TFLOPS),
    660 / 989,
    3000 / 3350,
    f"prefill: {_FA3}; decode: FlashMLA README (deepseek-ai/FlashMLA): 660 TFLOPS compute-bound, 3,000 GB/s "
    "memory-bound on H800 SXM5 (compute-bound when heads x queries >= 128, FlashMLA deep-dive 2025-04-22)",
)
ASCEND_ATTENTION = AttentionTable(
    _FA3_LENS,
    tuple(0.654 * tf / _FA3_TFLOPS[-1] for tf in _FA3_TFLOPS),
    0.654,
    0.841,
    f"{CM_INFER}: MLA 65.4% of peak compute-bound, 84.1% of bandwidth memory-bound; the prefill length "
    f"curve is FlashAttention-3's shape ({_FA3}) scaled to 65.4% at 16K (no 910C curve at hand)",
)


@dataclass(frozen=True)
class EpTable:
    """EP dispatch/combine bytes/s per device by EP size; `comm_sm_fraction`: cores used; `floor`: the
    `(ep_sizes, dispatch_s, combine_s)` one call takes however few tokens it moves (None: no floor)."""

    ep_sizes: tuple[int, ...]
    dispatch_bytes_per_s: tuple[float, ...]
    combine_bytes_per_s: tuple[float, ...]
    comm_sm_fraction: float
    source: str
    floor: tuple[tuple[int, ...], tuple[float, ...], tuple[float, ...]] | None = None

    def bandwidth(self, ep: int) -> tuple[float, float]:
        """`(dispatch, combine)` bytes/s per device at EP size `ep`."""
        sizes = self.ep_sizes
        return interpolate_log(sizes, self.dispatch_bytes_per_s, ep), interpolate_log(
            sizes, self.combine_bytes_per_s, ep
        )

    def latency_floor_s(self, ep: int) -> tuple[float, float]:
        """`(dispatch, combine)` seconds of one call at EP size `ep` however few tokens; 0 without a floor."""
        if self.floor is None:
            return 0.0, 0.0
        sizes, dispatch, combine = self.floor
        return interpolate_log(sizes, dispatch, ep), interpolate_log(sizes, combine, ep)


PPLX = (
    "pplx-kernels README, 'Benchmark Results', 1 token per GPU (github.com/perplexityai/pplx-kernels at "
    "2bd6e30): IBGDA dispatch/combine at EP16-EP128, NVLink at EP8 (one node of 8 GPUs; GPU and NIC not "
    "named, its 128-token table sits beside DeepEP's H800 figures)"
)
DEEPEP = "DeepEP README, 'Performance' (github.com/deepseek-ai/DeepEP at 567632d): H800, CX7 400 Gb/s per GPU"
HOPPER_EP_LOW_LATENCY = EpTable(
    (8, 16, 32, 64, 128, 256),
    tuple(g * GIGA for g in (98, 63, 48, 43, 39, 39)),
    tuple(g * GIGA for g in (127, 74, 53, 46, 39, 40)),
    0.0,
    f"{DEEPEP}, low-latency kernels (pure RDMA, 128 tokens per rank, FP8 dispatch, BF16 combine); they hold "
    "no SMs while the transfer runs (DeepEP README; DeepSeek profile-data README, decoding); the floor of a "
    f"call moving ~1 token per rank: {PPLX} (the same GPU-initiated RDMA path)",
    ((8, 16, 32, 64, 128), (41.6e-6, 102.7e-6, 115.7e-6, 121.0e-6, 125.9e-6),
     (41.7e-6, 62.7e-6, 55.4e-6, 58.6e-6, 63.2e-6)),
)  # fmt: skip
HOPPER_EP_NORMAL = EpTable(
    (8, 16, 32, 64),
    tuple(g * GIGA for g in (153, 43, 58, 51)),
    tuple(g * GIGA for g in (158, 43, 57, 50)),
    20 / 132,
    f"{DEEPEP}, normal kernels (NVLink within a node, RDMA bottleneck bandwidth between nodes); 20 of the "
    "132 SMs serve communication (DeepSeek-V3 report, arXiv:2412.19437, section 3.2.2)",
)


@dataclass(frozen=True)
class KernelTables:
    """One device kind's tables: GEMMs by layout, attention, EP (None: `comm_costs`'s model)."""

    gemm: dict[str, GemmTable]
    attention: AttentionTable
    ep_decode: EpTable | None = None
    ep_prefill: EpTable | None = None

    def gemm_fractions(self, layout: str, m: float, n: int, k: int) -> tuple[float, float]:
        """`GemmTable.fractions` of `layout`, the dense rows below a grouped layout's smallest M."""
        table = self.gemm[layout]
        if layout != "dense" and m < table.min_m:
            table = self.gemm["dense"]
        return table.fractions(m, n, k)


HOPPER_TABLES = KernelTables(HOPPER_GEMM, HOPPER_ATTENTION, HOPPER_EP_LOW_LATENCY, HOPPER_EP_NORMAL)
ASCEND_TABLES = KernelTables(ASCEND_GEMM, ASCEND_ATTENTION)


def tables_for(accelerator: str) -> KernelTables | None:
    """The published tables of catalog entry `accelerator` (None where none are at hand, e.g. `cpu`)."""
    if accelerator in ("h100", "h200", "h800"):
        return HOPPER_TABLES
    if accelerator in ("ascend-910b", "ascend-910c"):
        return ASCEND_TABLES
    return None
