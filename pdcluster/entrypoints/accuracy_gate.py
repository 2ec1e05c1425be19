"""The accuracy gate: measure the configuration a topology describes against the full-precision reference
(`engine.accuracy`) per length band, and check the thresholds of its `accuracy` section.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from pdcluster.config import Topology
from pdcluster.engine.accuracy import (
    BandMetrics,
    compare_teacher_forced,
    emulate_weight_dtype_,
    greedy_generate,
    repetition_rate,
    stream_windows,
)
from pdcluster.engine.kv_precision import KVPrecisionPolicy
from pdcluster.models.deepseek_v3 import DeepseekV3ForCausalLM
from pdcluster.models.dtypes import MODEL_DTYPES

GENERATION_PROMPT_TOKENS = 32


@dataclass(frozen=True)
class AccuracyReport:
    """Per-band metrics (band name -> `BandMetrics`), the configuration measured, and the gate's verdict:
    `failures` lists `band: metric value vs threshold` for each threshold not met (empty: passed).
    """

    topology: str
    configuration: dict
    metrics: dict[str, BandMetrics]
    failures: list[str]

    @property
    def passed(self) -> bool:
        return not self.failures

    def mtp_acceptance_by_kv_dtype(self) -> dict[str, float]:
        """Measured MTP acceptance per band KV dtype (mean over bands of that dtype): the planner's input
        (`planner.memory.mtp_acceptance_for_request`).
        """
        by_dtype: dict[str, list[float]] = {}
        for m in self.metrics.values():
            if m.mtp_acceptance is not None:
                by_dtype.setdefault(m.kv_dtypes, []).append(m.mtp_acceptance)
        return {dtype: sum(v) / len(v) for dtype, v in by_dtype.items()}

    def to_json(self) -> dict:
        return {
            "topology": self.topology,
            "configuration": self.configuration,
            "metrics": {name: dataclasses.asdict(m) for name, m in self.metrics.items()},
            "mtp_acceptance_by_kv_dtype": self.mtp_acceptance_by_kv_dtype(),
            "passed": self.passed,
            "failures": self.failures,
        }


def kv_policy(topology: Topology) -> KVPrecisionPolicy:
    """The topology's KV precision policy: `kv_precision`, else one band of decode's `kv_cache_dtype`."""
    if topology.kv_precision is not None:
        return topology.kv_precision.policy()
    return KVPrecisionPolicy.single(topology.decode.kv_cache_dtype)


def band_lengths(topology: Topology, context_len: int) -> dict[str, int]:
    """Evaluation length of each band (tokens): the `kv_precision` bands' bounds (the last: the context), else
    `accuracy.band_lengths`, else the context / 8, / 2 and all of it; capped at the context.
    """
    if topology.kv_precision is not None:
        bands = topology.kv_precision.named_bands()
        return {n: min(b.max_tokens or context_len, context_len) for n, b in bands}
    if topology.accuracy.band_lengths is not None:
        lengths = [int(p) for p in topology.accuracy.band_lengths.split(",")]
    else:
        lengths = [context_len // 8, context_len // 2, context_len]
    return dict(zip(("short", "medium", "long"), (min(n, context_len) for n in lengths), strict=True))


def gate_failures(topology: Topology, metrics: dict[str, BandMetrics]) -> list[str]:
    """Thresholds of `topology.accuracy` not met, one `band: metric ...` line each."""
    acc = topology.accuracy
    failures = []
    for name, m in metrics.items():
        if acc.min_top1_agreement is not None and m.top1_agreement < acc.min_top1_agreement:
            failures.append(
                f"{name}: top1_agreement {m.top1_agreement:.4f} < min_top1_agreement {acc.min_top1_agreement}"
            )
        if acc.max_mean_kl is not None and m.mean_kl > acc.max_mean_kl:
            failures.append(f"{name}: mean_kl {m.mean_kl:.4g} > max_mean_kl {acc.max_mean_kl}")
        for metric, value, reference, limit_name, worse in (  # worse: +1 higher is worse, -1 lower
            ("mtp_acceptance", m.mtp_acceptance, m.reference_mtp_acceptance, "max_mtp_acceptance_drop", -1),
            (
                "repetition_rate",
                m.repetition_rate,
                m.reference_repetition_rate,
                "max_repetition_rate_increase",
                1,
            ),
        ):
            limit = getattr(acc, limit_name)
            if None not in (limit, value, reference) and worse * (value - reference) > limit:
                failures.append(
                    f"{name}: {metric} {value:.4f} vs reference {reference:.4f}, > {limit_name} {limit}"
                )
    return failures


def evaluate_topology(topology: Topology, block_size: int | None = None) -> AccuracyReport:
    """Measure `topology`'s configuration against the float32 reference; see the module docstring.
    Raises ValueError: the held-out text is too short for the bands, or an unknown weight dtype;
    models.loader.CheckpointError: the checkpoint cannot be read."""
    from pdcluster.models.corpus import read_documents
    from pdcluster.models.tokenizer import Tokenizer

    spec = topology.hardware.spec
    path = topology.model.checkpoint_dir
    dtype_name = topology.model.resolved_dtype(spec)
    weight_dtype = topology.model.resolved_weight_dtype(spec)
    torch.manual_seed(0)
    reference = DeepseekV3ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model = reference
    if dtype_name != "float32" or weight_dtype != "float32":
        model = DeepseekV3ForCausalLM.from_pretrained(path, dtype=MODEL_DTYPES[dtype_name]).eval()
    if weight_dtype != dtype_name:
        emulate_weight_dtype_(model, weight_dtype)
    cfg = reference.config
    num_layers = cfg.num_hidden_layers + cfg.num_nextn_predict_layers
    context = min(topology.decode.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
    policy = kv_policy(topology)
    block_size = block_size or topology.decode.block_size
    tokenizer = Tokenizer.from_dir(path)
    stream: list[int] = []
    for ids in tokenizer.encode_batch(read_documents("heldout")):
        stream += [*ids, tokenizer.eos_token_id]
    mtp = topology.decode.num_speculative_tokens > 0 and cfg.num_nextn_predict_layers > 0
    model_dtype = MODEL_DTYPES[dtype_name]
    metrics: dict[str, BandMetrics] = {}
    lengths = band_lengths(topology, context)
    long_name = list(lengths)[-1]
    for name, length in lengths.items():
        band = policy.bands[policy.band_index(length)]
        dtypes = band.layer_dtypes(num_layers, model_dtype)
        windows = stream_windows(stream, length, topology.accuracy.num_prompts)
        tf = compare_teacher_forced(reference, model, dtypes, windows, block_size)
        rep = ref_rep = None
        if name == long_name:
            starts = stream_windows(stream, GENERATION_PROMPT_TOKENS, topology.accuracy.num_generations)
            prompts = starts.tolist()
            new = length - GENERATION_PROMPT_TOKENS
            ref_dtypes = (torch.float32,) * num_layers
            ref_outs = greedy_generate(reference, ref_dtypes, prompts, new, block_size)
            same = model is reference and dtypes == ref_dtypes
            outs = ref_outs if same else greedy_generate(model, dtypes, prompts, new, block_size)
            rep = sum(map(repetition_rate, outs)) / len(outs)
            ref_rep = sum(map(repetition_rate, ref_outs)) / len(ref_outs)
        metrics[name] = BandMetrics(
            length=length,
            kv_dtypes=band.describe(),
            top1_agreement=tf["top1_agreement"],
            mean_kl=tf["mean_kl"],
            mtp_acceptance=tf["mtp_acceptance"] if mtp else None,
            reference_mtp_acceptance=tf["reference_mtp_acceptance"] if mtp else None,
            repetition_rate=rep,
            reference_repetition_rate=ref_rep,
        )
    configuration = {
        "model_dtype": dtype_name,
        "weight_dtype": weight_dtype,
        "kv_policy": [(b.max_tokens, b.describe()) for b in policy.bands],
        "num_speculative_tokens": topology.decode.num_speculative_tokens,
        "expert_parallel_size": topology.decode.expert_parallel_size,
        "ep_emulated": False,
        "block_size": block_size,
    }
    return AccuracyReport(topology.name, configuration, metrics, gate_failures(topology, metrics))


def format_report(report: AccuracyReport) -> str:
    """The report as a table plus the gate's verdict, one line per failure."""
    lines = [
        f"{'band':<7} {'length':>6}  {'KV dtype':<34} {'top1':>7} {'mean KL':>9} {'MTP acc (ref)':>15} "
        f"{'repetition (ref)':>17}"
    ]

    def pair(a: float | None, b: float | None) -> str:
        return "-" if a is None or b is None else f"{a:.3f} ({b:.3f})"

    for name, m in report.metrics.items():
        lines.append(
            f"{name:<7} {m.length:>6}  {m.kv_dtypes:<34} {m.top1_agreement:>7.4f} {m.mean_kl:>9.2e} "
            f"{pair(m.mtp_acceptance, m.reference_mtp_acceptance):>15} "
            f"{pair(m.repetition_rate, m.reference_repetition_rate):>17}"
        )
    c = report.configuration
    lines.append(
        f"configuration: model {c['model_dtype']}, weights {c['weight_dtype']}, "
        f"MTP k={c['num_speculative_tokens']}, EP {c['expert_parallel_size']} (measured as one process)"
    )
    lines.append("gate: passed" if report.passed else "gate: FAILED")
    lines += [f"  {f}" for f in report.failures]
    return "\n".join(lines)
