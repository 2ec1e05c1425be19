"""`pdcluster profile`: measure the live engine here and fit the `cpu` catalog entry's efficiency factors.

Step times per grid point are CPU seconds of the stepping thread (torch at 1 thread, fastest repeat), so
other processes' load stays out; KV handoffs fit `seconds = fixed + bytes / bandwidth`; the factors of
`host + n_ops op_overhead + sum_ops max(flops a, bytes b)` are fitted by NNLS on relative errors.
"""

from __future__ import annotations

import json
import math
import platform
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pdcluster.planner.calibration import FORMAT
from pdcluster.planner.efficiency import Efficiency
from pdcluster.planner.perf_model import PerfModel
from pdcluster.planner.step_model import DecodeRow, PrefillChunk, StepShape

WARMUP_STEPS = 2
# (batch, prompt_len) prefill points and (batch, context_len) decode points.
DEFAULT_PREFILL = ((1, 32), (1, 128), (1, 512), (4, 64), (4, 256), (8, 128))
DEFAULT_DECODE = ((1, 64), (4, 64), (16, 64), (32, 128), (8, 512), (48, 256))
QUICK_PREFILL = ((1, 16), (2, 64))
QUICK_DECODE = ((1, 16), (4, 32))
KV_TOKENS = (256, 1024, 4096)
QUICK_KV_TOKENS = (64, 512)
UNKNOWNS = ("host_overhead_s", "op_overhead_s", "gemm_compute", "gemm_memory", "attention_compute",
            "attention_memory", "memory")  # fmt: skip


@dataclass
class Sample:
    """One grid point measured: pool `role`, `batch`, `length` (prompt or context tokens), the `step` priced,
    per-repeat thread CPU seconds (`times_s`, fitted) and wall seconds."""

    role: str
    batch: int
    length: int
    step: StepShape
    times_s: list[float]
    wall_s: list[float] = field(default_factory=list)

    @property
    def median_s(self) -> float:
        return statistics.median(self.times_s)

    @property
    def best_s(self) -> float:
        """The fastest repeat's CPU seconds (contention only adds time)."""
        return min(self.times_s)


@dataclass(frozen=True)
class Grid:
    prefill: Sequence[tuple[int, int]]
    decode: Sequence[tuple[int, int]]
    repeats: int
    decode_steps: int
    kv_tokens: Sequence[int]

    @classmethod
    def default(cls, quick: bool = False) -> Grid:
        if quick:
            return cls(QUICK_PREFILL, QUICK_DECODE, 1, 3, QUICK_KV_TOKENS)
        return cls(DEFAULT_PREFILL, DEFAULT_DECODE, 3, 6, KV_TOKENS)


def _timed_step(engine) -> tuple[float, float]:
    """`(wall seconds, CPU seconds of this thread)` of one `engine.step()`."""
    wall, cpu = time.perf_counter(), time.thread_time()
    engine.step()
    return time.perf_counter() - wall, time.thread_time() - cpu


def _prompts(rng: random.Random, batch: int, length: int, vocab: int) -> list[list[int]]:
    return [[rng.randrange(2, vocab) for _ in range(length)] for _ in range(batch)]


def measure_prefill(
    engine, batch: int, prompt_len: int, repeats: int, rng: random.Random
) -> list[tuple[float, float]]:
    """`_timed_step` of the step that prefills `batch` fresh prompts of `prompt_len` tokens, per repeat."""
    from pdcluster.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    out = []
    for _ in range(repeats):
        ids = [engine.add_request(p, params) for p in _prompts(rng, batch, prompt_len, engine.config_vocab)]
        out.append(_timed_step(engine))
        while engine.has_unfinished_requests():
            engine.step()
        engine.pop_finished_outputs(ids)
    return out


def measure_decode(
    engine, batch: int, context_len: int, num_steps: int, rng: random.Random
) -> list[tuple[float, float]]:
    """`_timed_step` of each of `num_steps` decode steps of `batch` requests at about `context_len` tokens."""
    from pdcluster.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=4 * (WARMUP_STEPS + num_steps) + 8, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in _prompts(rng, batch, context_len, engine.config_vocab)]
    while any(engine.scheduler.get_request(r).num_computed_tokens < context_len for r in ids):
        engine.step()
    for _ in range(WARMUP_STEPS):
        engine.step()
    out = [_timed_step(engine) for _ in range(num_steps)]
    for rid in ids:
        engine.abort_request(rid)
    engine.pop_finished_outputs(ids)
    return out


def measure_steps(topology, grid: Grid, progress: Callable[[str], None], seed: int = 0) -> list[Sample]:
    """Every step sample of `grid` on both pools' engines, torch at one thread as deployed."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _measure_steps(topology, grid, progress, seed)
    finally:
        torch.set_num_threads(threads)


def _measure_steps(topology, grid: Grid, progress: Callable[[str], None], seed: int) -> list[Sample]:
    from pdcluster.engine.llm_engine import LLMEngine

    rng = random.Random(seed)
    samples = []
    k = topology.decode.num_speculative_tokens
    for role in ("prefill", "decode"):
        config = topology.engine_config(role)
        engine = LLMEngine(config)
        engine.config_vocab = engine.model.config.vocab_size
        measure_decode(engine, 2, 16, 1, rng)  # warm-up, untimed: first calls allocate and load kernels
        budget, seats = config.max_num_batched_tokens, config.max_num_seqs
        for batch, length in grid.prefill if role == "prefill" else grid.decode:
            if role == "prefill" and (batch * length > budget or batch > seats):
                continue
            if role == "decode" and batch > seats:
                continue
            if role == "prefill":
                times = measure_prefill(engine, batch, length, grid.repeats, rng)
                step = StepShape(prefill=(PrefillChunk(length),) * batch)
            else:
                times = measure_decode(engine, batch, length, grid.decode_steps, rng)
                ctx = length + WARMUP_STEPS + grid.decode_steps // 2
                step = StepShape(decode=(DecodeRow(ctx, 1 + k),) * batch, num_speculative_tokens=k)
            samples.append(Sample(role, batch, length, step, [t[1] for t in times], [t[0] for t in times]))
            progress(f"{role} batch={batch} len={length}")
        del engine
    return samples


def measure_kv(
    config, dtype: str, token_counts: Sequence[int], repeats: int, transport: str = "grpc"
) -> dict[str, Any]:
    """KV handoffs over `transport` (others than shm measured as grpc) at `token_counts` sizes: the raw points
    and `fixed_s`, `bytes_per_s` fitted by NNLS through the fastest repeats."""
    from pdcluster.kvtransfer.loopback_bench import bench_pair
    from pdcluster.planner.calibration import measured_kv_transport

    transport = measured_kv_transport(transport)

    points = []
    for n in token_counts:
        shape = {
            "num_layers": config.num_hidden_layers + config.num_nextn_predict_layers,
            "num_tokens": n,
            "kv_dim": config.kv_cache_dim,
            "dtype": dtype,
        }
        result = bench_pair(transport, shape, "model", repeats, sender_in="process")
        points.append({"num_tokens": n, "kv_bytes": result["kv_bytes"],
                       "best_s": min(result["elapsed_ms"]) / 1e3,
                       "median_s": statistics.median(result["elapsed_ms"]) / 1e3})  # fmt: skip
    a = np.array([[1.0, p["kv_bytes"]] for p in points])
    y = np.array([p["best_s"] for p in points])
    fixed, slope = nnls(a / y[:, None], np.ones(len(y)))  # relative errors
    if slope <= 0:  # sizes too close to tell bandwidth from the fixed cost: the largest point's average
        fixed, slope = 0.0, y[-1] / a[-1, 1]
    return {
        "transport": transport,
        "points": points,
        "fixed_s": float(fixed),
        "bytes_per_s": float(1.0 / slope),
    }


def nnls(a: np.ndarray, b: np.ndarray, max_iter: int = 200) -> np.ndarray:
    """Non-negative least squares `min |a x - b|, x >= 0` (Lawson & Hanson 1974, ch. 23 active-set method)."""
    m, n = a.shape
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    for _ in range(max_iter):
        w = a.T @ (b - a @ x)
        if passive.all() or (w[~passive] <= 1e-12 * max(1.0, np.abs(w).max())).all():
            break
        j = int(np.argmax(np.where(passive, -np.inf, w)))
        passive[j] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            neg = passive & (z <= 0)
            alpha = np.min(x[neg] / (x[neg] - z[neg]))
            x = x + alpha * (z - x)
            passive &= x > 1e-15
    return x


def _features(model: PerfModel, step: StepShape, regime: dict[tuple[str, str], bool]) -> np.ndarray:
    """Seconds at unit inverse-efficiency per unknown of `UNKNOWNS`, ops assigned by `regime`."""
    f = np.zeros(len(UNKNOWNS))
    f[0] = 1.0
    spec = model.spec
    peaks = {"gemm": spec.matmul_flops_per_s(model.dtypes.weight),
             "attention": spec.matmul_flops_per_s(model.dtypes.activation)}  # fmt: skip
    bw = spec.hbm_bytes_per_s
    col = {("gemm", True): 2, ("gemm", False): 3, ("attention", True): 4, ("attention", False): 5,
           ("memory", False): 6}  # fmt: skip
    for op in model.ops(step):
        f[1] += op.count
        compute = op.kind != "memory" and regime.get((op.name, op.kind), False)
        amount = op.flops / peaks[op.kind] if compute else op.bytes / bw
        f[col[(op.kind, compute)]] += amount * op.count
    return f


def fit_efficiency(
    models: dict[str, PerfModel], samples: Sequence[Sample], base: Efficiency, max_rounds: int = 8
) -> tuple[Efficiency, dict[str, Any]]:
    """Fit `base`'s step-time factors to `samples`; returns the round with the least rms relative error and a
    report (`rounds`, `rms_rel_error`, `not_identified`)."""
    y = np.array([s.best_s for s in samples])
    w = 1.0 / y
    current, regimes = base, None
    best: tuple[float, Efficiency, np.ndarray, list[str]] | None = None
    rounds = 0
    while rounds < max_rounds:
        rounds += 1
        new_regimes = []
        for s in samples:
            priced = models[s.role].with_efficiency(current)
            new_regimes.append({(op.name, op.kind): priced.op_time_s(op)[1] for op in priced.ops(s.step)})
        if new_regimes == regimes:
            break
        regimes = new_regimes
        a = np.array([_features(models[s.role], s.step, r) for s, r in zip(samples, regimes, strict=True)])
        x = nnls(a * w[:, None], y * w)
        current, not_identified = _efficiency_from(x, a, base)
        predicted = np.array([models[s.role].with_efficiency(current).step_time_s(s.step) for s in samples])
        rms = float(np.sqrt(np.mean((predicted * w - 1.0) ** 2)))
        if best is None or rms < best[0]:
            best = (rms, current, x, not_identified)
    assert best is not None
    rms, eff, x, not_identified = best
    return eff, {
        "rounds": rounds,
        "rms_rel_error": rms,
        "inverse_efficiency_solution": x.tolist(),
        "not_identified": not_identified,
    }


def _efficiency_from(x: np.ndarray, a: np.ndarray, base: Efficiency) -> tuple[Efficiency, list[str]]:
    values: dict[str, float] = {}
    missing = []
    for i, name in enumerate(UNKNOWNS):
        seen = a[:, i].any()
        if i < 2:  # seconds
            if seen:
                values[name] = float(x[i])
            else:
                missing.append(name)
        elif seen and x[i] > 0:
            values[name] = float(1.0 / x[i])
        else:
            missing.append(name)
    return base.replace(**values), missing


def residuals(
    models: dict[str, PerfModel], samples: Sequence[Sample], eff: Efficiency
) -> list[dict[str, Any]]:
    """Per sample: measured and predicted seconds and the relative error `predicted / measured - 1`."""
    rows = []
    for s in samples:
        pred = models[s.role].with_efficiency(eff).step_time_s(s.step)
        rows.append({"role": s.role, "batch": s.batch, "length": s.length, "measured_s": s.best_s,
                     "measured_median_s": s.median_s, "wall_median_s": statistics.median(s.wall_s or [0.0]),
                     "predicted_s": pred, "rel_error": pred / s.best_s - 1.0})  # fmt: skip
    return rows


def summary_table(rows: Sequence[dict[str, Any]], kv: dict[str, Any] | None) -> str:
    """The text table written next to the JSON (and printed)."""
    lines = [f"{'role':<8}{'batch':>6}{'len':>6}{'measured_ms':>13}{'predicted_ms':>14}{'error':>9}"]
    for r in rows:
        lines.append(f"{r['role']:<8}{r['batch']:>6}{r['length']:>6}{r['measured_s'] * 1e3:>13.2f}"
                     f"{r['predicted_s'] * 1e3:>14.2f}{r['rel_error'] * 100:>8.1f}%")  # fmt: skip
    errs = [abs(r["rel_error"]) for r in rows]
    if errs:
        rms = math.sqrt(sum(e * e for e in errs) / len(errs))
        lines.append(f"step time: rms relative error {rms * 100:.1f}%, max {max(errs) * 100:.1f}% "
                     f"over {len(errs)} samples")  # fmt: skip
    if kv:
        where = "shared memory" if kv.get("transport") == "shm" else "grpc, loopback"
        lines.append(f"kv transfer ({where}): {kv['bytes_per_s'] / 1e9:.3f} GB/s, "
                     f"{kv['fixed_s'] * 1e3:.2f} ms per handoff")  # fmt: skip
    return "\n".join(lines)


def write_calibration(path: Path, accelerator: str, eff: Efficiency, report: dict[str, Any]) -> None:
    """The calibration JSON (`planner.calibration.FORMAT`) and a `.txt` table beside it."""
    factors = {name: getattr(eff, name).value for name in report["fitted_factors"]}
    doc = {
        "format": FORMAT,
        "accelerator": accelerator,
        "factors": factors,
        **report,
        "host": {"machine": platform.machine(), "python": platform.python_version()},
        "note": "measured under whatever load this machine had; rerun on a quiet machine to compare",
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
