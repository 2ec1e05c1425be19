"""Efficiency factors: the fraction of a catalog peak each kind of op reaches, and fixed costs, each `Factor`
with its source; `planner.kernel_tables` replaces them shape by shape where published tables exist."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class Factor:
    """One number and where it comes from. `value`: a fraction of a peak (0, 1.5] or seconds (>= 0)."""

    value: float
    source: str

    def __post_init__(self) -> None:
        if not self.value >= 0:
            raise ValueError(f"efficiency factor must be >= 0, got {self.value!r} ({self.source})")


@dataclass(frozen=True)
class Efficiency:
    """Per-op efficiency of one accelerator kind: fractions of the matrix peak or bandwidth (`gemm_*`,
    `attention_*`, `memory`, `link`, `kv_link`), seconds per step / op / handoff (`*_overhead_s`), lognormal
    spreads of expert routing and popularity (`planner.imbalance`), and the fraction of published kernel rates
    reached in decode and prefill steps (`serving_fraction`, `prefill_serving_fraction`)."""

    gemm_compute: Factor
    gemm_memory: Factor
    attention_compute: Factor
    attention_memory: Factor
    memory: Factor
    link: Factor
    kv_link: Factor
    host_overhead_s: Factor
    op_overhead_s: Factor
    handoff_overhead_s: Factor
    routing_sigma: Factor = Factor(0.0, "uniform routing assumed (no routing statistics at hand)")
    popularity_sigma: Factor = Factor(
        0.0,
        "flat long-run popularity assumed (DeepSeek-V3's auxiliary-loss-free balancing; no statistics)",
    )
    serving_fraction: Factor = Factor(1.0, "the microbenchmark rates as published")
    prefill_serving_fraction: Factor = Factor(1.0, "the microbenchmark rates as published")

    def replace(self, **values: float) -> Efficiency:
        """A copy with some factors' values replaced, sourced `measured here`."""
        changes = {k: Factor(v, "measured here (pdcluster profile)") for k, v in values.items()}
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, dict[str, float | str]]:
        return {f.name: dataclasses.asdict(getattr(self, f.name)) for f in dataclasses.fields(self)}


_DEEPGEMM = Factor(
    0.68,
    "DeepGEMM README (deepseek-ai/DeepGEMM, Feb 2025): 'up to 1350+ FP8 TFLOPS' on H800 of 1,979 dense",
)
_FLASHMLA_COMPUTE = Factor(
    0.667,
    "FlashMLA README (deepseek-ai/FlashMLA): up to 660 TFLOPS compute-bound on H800 SXM5 (66.7% of 989 "
    "BF16 TFLOPS; the AMLA paper, arXiv:2509.25224, quotes the same 66.7%)",
)
_FLASHMLA_MEMORY = Factor(0.9, "FlashMLA README: up to 3,000 GB/s memory-bound on H800 SXM5 (of 3.35 TB/s)")
_DEEPEP_LL = Factor(
    0.78,
    "DeepEP README, low-latency kernels on H800 + CX7 400 Gb/s (~50 GB/s): EP128-256 dispatch/combine "
    "reach 39-40 GB/s",
)
_HOST_H800 = Factor(
    1.5e-3,
    "RTP-LLM DeepSeek Reproduce Tech Report (alibaba/rtp-llm docs), same EP32/EP144 H800 deployment: host "
    "time between forward steps ~1.5 ms (its ~2 ms kernel-launch overhead is left out: graph capture)",
)
_HOST_ASCEND = Factor(1.5e-3, "proxy: RTP-LLM's H800 host time per step (none published for 910C at hand)")
_FIT = "by `pdcluster plan --validate --fit` (planner.fit); checked on the other deployments"
_ROUTING = Factor(
    1.8008,
    "fitted on cm-prefill: CloudMatrix-Infer's 5,655 tok/s per NPU measured over 6,688 under perfect expert "
    f"balance (arXiv:2506.12708), {_FIT}",
)
_SERVING = Factor(0.7263, f"fitted on h800-decode: DeepSeek Day 6's production TPOT, {_FIT}")
_PREFILL_SERVING = Factor(0.6771, f"fitted on h800-prefill: RTP-LLM's 1.5 s step of 2 x 4K prompts, {_FIT}")
_NO_OP_OVERHEAD = Factor(
    0.0, "assumed 0 under graph capture (kernels queued back to back); not a measurement"
)
_HANDOFF_ACCEL = Factor(
    1e-3, "assumed 1 ms per handoff (RDMA registration + control message); no published figure at hand"
)
# the factors every accelerator entry shares (fitted ones are checked on every deployment, `planner.fit`)
_ACCELERATOR_SHARED = {
    "memory": Factor(0.9, "proxy: FlashMLA's memory-bound fraction (no elementwise microbenchmark at hand)"),
    "op_overhead_s": _NO_OP_OVERHEAD,
    "handoff_overhead_s": _HANDOFF_ACCEL,
    "routing_sigma": _ROUTING,
    "serving_fraction": _SERVING,
    "prefill_serving_fraction": _PREFILL_SERVING,
}

HOPPER = Efficiency(
    gemm_compute=_DEEPGEMM,
    gemm_memory=Factor(
        0.7,
        "DeepGEMM README grouped/normal GEMM tables on H800: small-M (decode) shapes move ~2.0-2.7 TB/s of "
        "3.35 (approximate reading)",
    ),
    attention_compute=_FLASHMLA_COMPUTE,
    attention_memory=_FLASHMLA_MEMORY,
    link=_DEEPEP_LL,
    kv_link=Factor(0.78, "proxy: DeepEP's RDMA fraction (KV transfer also rides the 400 Gb/s NIC)"),
    host_overhead_s=_HOST_H800,
    **_ACCELERATOR_SHARED,
)

ASCEND = Efficiency(
    gemm_compute=Factor(
        0.68,
        "proxy: DeepGEMM's FP8 fraction on H800; no published Ascend 910C INT8 GEMM microbenchmark at hand",
    ),
    gemm_memory=Factor(
        0.7, "proxy: the Hopper weight-streaming GEMM fraction (none published for 910C at hand)"
    ),
    attention_compute=Factor(
        0.654,
        "CloudMatrix-Infer MLA operator (Zuo et al., arXiv:2506.12708, operator evaluation): 65.4% of the "
        "910C's BF16 peak compute-bound (read from secondary summaries of the paper's table)",
    ),
    attention_memory=Factor(
        0.841,
        "CloudMatrix-Infer MLA operator (arXiv:2506.12708): 84.1% of HBM bandwidth memory-bound (read from "
        "secondary summaries of the paper's table)",
    ),
    link=Factor(
        0.78, "proxy: DeepEP low-latency fraction on H800 RDMA; no UB all-to-all microbenchmark at hand"
    ),
    kv_link=Factor(0.78, "proxy: DeepEP low-latency fraction (KV over UB)"),
    host_overhead_s=_HOST_ASCEND,
    **_ACCELERATOR_SHARED,
)

CPU = Efficiency(
    gemm_compute=Factor(0.5, "placeholder until `pdcluster profile` measures it (no published figure)"),
    gemm_memory=Factor(0.5, "placeholder until `pdcluster profile` measures it"),
    attention_compute=Factor(0.2, "placeholder: torch einsum attention (padded), until measured"),
    attention_memory=Factor(0.5, "placeholder until `pdcluster profile` measures it"),
    memory=Factor(0.5, "placeholder until `pdcluster profile` measures it"),
    link=Factor(0.5, "placeholder: gloo over loopback, until measured"),
    kv_link=Factor(
        1.0, "placeholder: KV throughput is measured by `pdcluster profile` (bench/kv_transfer.py)"
    ),
    host_overhead_s=Factor(2e-3, "placeholder: bench/engine_step.py's order of magnitude, until measured"),
    op_overhead_s=Factor(2e-5, "placeholder: torch eager dispatch per op, until measured"),
    handoff_overhead_s=Factor(5e-3, "placeholder: gRPC reservation + stream setup, until measured"),
)

EFFICIENCY: dict[str, Efficiency] = {
    "cpu": CPU,
    "ascend-910b": ASCEND,
    "ascend-910c": ASCEND,
    "h100": HOPPER,
    "h200": HOPPER,
    "h800": HOPPER,
    "a100": dataclasses.replace(
        HOPPER,
        gemm_compute=Factor(0.7, "proxy: the Hopper GEMM fraction (cuBLAS BF16 on A100 is similar)"),
    ),
}


def get_efficiency(accelerator: str) -> Efficiency:
    """The factors of catalog entry `accelerator`; raises KeyError listing the known names."""
    try:
        return EFFICIENCY[accelerator]
    except KeyError:
        raise KeyError(f"no efficiency factors for {accelerator!r}; known: {', '.join(EFFICIENCY)}") from None
