"""Search over splits of one topology's hardware, ranked by goodput per device under its SLO.

`candidate_topologies` varies devices per instance, EP degree, decode `max_num_seqs`, MTP k and instance
counts on the file's nodes, keeping what `check_topology` and deploy's preflight accept; `fits_in_memory`
drops splits whose weights + KV cache exceed a device; `search` simulates and ranks the rest; `plan_yaml`
writes the best as a topology file.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

from pdcluster.config import TLS_FILE_KEYS, Topology
from pdcluster.models.config import DeepseekV3Config
from pdcluster.planner.memory import pool_memory_overflow
from pdcluster.planner.sim_results import SimResult
from pdcluster.planner.trace import TraceRequest


@dataclass(frozen=True)
class Evaluated:
    """One simulated candidate and the devices its two pools use."""

    topology: Topology
    num_devices: int
    result: SimResult

    @property
    def goodput_per_device(self) -> float:
        """Requests per second meeting the SLO, per device used."""
        return self.result.summary["goodput_requests_per_s"] / self.num_devices

    @property
    def pd_ratio(self) -> float:
        """Prefill devices per decode device."""
        return self.topology.prefill.num_devices / self.topology.decode.num_devices


def describe(topology: Topology) -> str:
    """One line: `P 14x32 (EP32), D 1x288 (EP288, max_num_seqs 27648, k=1)`."""
    p, d = topology.prefill, topology.decode
    return (
        f"P {p.num_instances}x{p.devices_per_instance} (EP{p.expert_parallel_size}), "
        f"D {d.num_instances}x{d.devices_per_instance} (EP{d.expert_parallel_size}, "
        f"max_num_seqs {d.max_num_seqs}, k={d.num_speculative_tokens})"
    )


def memory_overflows(
    topology: Topology, weight_dtype: str, config: DeepseekV3Config | None = None
) -> list[str]:
    """One line per pool of `topology` whose weights in `weight_dtype` plus KV cache exceed a device's memory.
    Raises ValueError for an unreadable model config.json or an unknown `weight_dtype`."""
    from pdcluster.config.rules import read_model_architecture

    cfg = config or read_model_architecture(topology.model)
    lines = []
    for role in ("prefill", "decode"):
        overflow = pool_memory_overflow(cfg, topology.pool(role), topology.hardware.spec, weight_dtype)
        if overflow is not None:
            lines.append(f"{role} {overflow}")
    return lines


def fits_in_memory(
    candidates: Sequence[Topology], weight_dtype: str, config: DeepseekV3Config | None = None
) -> tuple[list[Topology], list[Topology]]:
    """`candidates` split into `(fit, overflow)` by `memory_overflows`, each in the given order."""
    from pdcluster.config.rules import read_model_architecture

    if config is None and candidates:
        config = read_model_architecture(candidates[0].model)
    fit: list[Topology] = []
    overflow: list[Topology] = []
    for candidate in candidates:
        (overflow if memory_overflows(candidate, weight_dtype, config) else fit).append(candidate)
    return fit, overflow


def _instance_sizes(base: int, devices_per_node: int, num_devices: int) -> list[int]:
    sizes = []
    for size in (base // 2, base, base * 2):
        if 1 <= size <= num_devices and (size % devices_per_node == 0 if size > devices_per_node else True):
            sizes.append(size)
    return sorted(set(sizes))


def spread_counts(max_count: int, num: int) -> list[int]:
    """Up to `num` counts in [1, max_count], evenly spread, max_count included."""
    if max_count < 1:
        return []
    return sorted({max(1, round(max_count * (i + 1) / num)) for i in range(num)})


def candidate_topologies(
    base: Topology, num_decode_counts: int = 2, num_prefill_counts: int = 3
) -> Iterator[Topology]:
    """The candidates of `base`'s hardware that pass the topology rules but the memory one."""
    from pdcluster.config.preflight import actor_layer_issues
    from pdcluster.config.rules import cross_section_issues, read_model_architecture

    arch = read_model_architecture(base.model)
    arch_src = str(base.model.config_json)
    hw = base.hardware
    total, dpn = hw.num_devices, hw.devices_per_node
    p0, d0 = base.prefill, base.decode
    seqs_options = sorted({max(1, d0.max_num_seqs // 2), d0.max_num_seqs})
    k_options = sorted({0, d0.num_speculative_tokens})
    seen: set[tuple] = set()
    ep_splits = (1, 2) if p0.expert_parallel_size > 1 or d0.expert_parallel_size > 1 else (1,)
    for dp in _instance_sizes(p0.devices_per_instance, dpn, total):
        for dd in _instance_sizes(d0.devices_per_instance, dpn, total):
            for ep_split in ep_splits:
                for seqs in seqs_options:
                    for k in k_options:
                        max_decodes = (total - dp) // dd
                        for num_d in range(1, min(num_decode_counts, max_decodes) + 1):
                            for num_p in spread_counts((total - num_d * dd) // dp, num_prefill_counts):
                                candidate = _with_split(base, dp, dd, ep_split, seqs, k, num_p, num_d)
                                if candidate is None or (candidate.prefill, candidate.decode) in seen:
                                    continue
                                seen.add((candidate.prefill, candidate.decode))
                                sections = {
                                    f.name: getattr(candidate, f.name) for f in dataclasses.fields(candidate)
                                }
                                issues = cross_section_issues(sections, arch, arch_src, device_memory=False)
                                if not any(True for _ in issues) and not actor_layer_issues(candidate):
                                    yield candidate


def _pool(pool, num_instances: int, devices: int, ep_split: int, **changes):  # type: ignore[no-untyped-def]
    ep = devices // ep_split if pool.expert_parallel_size > 1 else 1
    if ep < 2:
        ep = 1 if pool.expert_parallel_size == 1 else devices
    return dataclasses.replace(
        pool,
        num_instances=num_instances,
        devices_per_instance=devices,
        expert_parallel_size=ep,
        num_redundant_experts=pool.num_redundant_experts if ep > 1 else 0,
        **changes,
    )


def _with_split(
    base: Topology, dp: int, dd: int, ep_split: int, seqs: int, k: int, num_p: int, num_d: int
) -> Topology | None:
    dpn = base.hardware.devices_per_node
    d0 = base.decode
    budget = max(1, d0.max_num_batched_tokens * seqs // d0.max_num_seqs)
    try:
        prefill = dataclasses.replace(
            _pool(base.prefill, num_p, dp, ep_split), span_nodes=dp > dpn or base.prefill.span_nodes
        )
        decode = dataclasses.replace(
            _pool(
                d0,
                num_d,
                dd,
                ep_split,
                max_num_seqs=seqs,
                max_num_batched_tokens=budget,
                num_speculative_tokens=k,
            ),
            span_nodes=dd > dpn or d0.span_nodes,
        )
        return dataclasses.replace(base, prefill=prefill, decode=decode)
    except ValueError:
        return None


def search(
    base: Topology,
    requests: Sequence[TraceRequest],
    simulate_one: Callable[[Topology, Sequence[TraceRequest]], SimResult],
    candidates: Sequence[Topology] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> list[Evaluated]:
    """Simulate every candidate; best first by goodput per device, fewer devices, lower p90 TPOT."""
    candidates = list(candidate_topologies(base)) if candidates is None else list(candidates)
    evaluated = []
    for i, candidate in enumerate(candidates):
        result = simulate_one(candidate, requests)
        num_devices = candidate.prefill.num_devices + candidate.decode.num_devices
        evaluated.append(Evaluated(candidate, num_devices, result))
        if progress is not None:
            progress(i + 1, len(candidates))

    def rank(e: Evaluated) -> tuple[float, int, float]:
        tpot_p90 = e.result.summary["tpot_ms"]["p90"]
        return (-e.goodput_per_device, e.num_devices, tpot_p90 if tpot_p90 is not None else float("inf"))

    return sorted(evaluated, key=rank)


def plan_yaml(source_path: str | Path, best: Topology, header: str, weight_dtype: str | None = None) -> str:
    """The topology file of `best`: the source YAML with the searched keys replaced, relative paths made
    absolute, `model.weight_dtype` set when it differs, and `header` as leading comment lines."""
    source_path = Path(source_path)
    data = yaml.safe_load(source_path.read_text()) or {}
    base_dir = source_path.resolve().parent
    tls = (data.get("kv_transfer") or {}).get("tls") or {}
    for section, keys in ((data.get("model") or {}, ("path", "config_path")), (tls, TLS_FILE_KEYS)):
        for key in keys:
            if section.get(key) and not Path(section[key]).is_absolute():
                section[key] = str((base_dir / section[key]).resolve())
    keys = (
        "num_instances",
        "devices_per_instance",
        "span_nodes",
        "expert_parallel_size",
        "num_redundant_experts",
        "max_num_seqs",
        "max_num_batched_tokens",
    )
    for role in ("prefill", "decode"):
        section = data.setdefault(role, {}) or {}
        pool = best.pool(role)
        for key in keys:
            section[key] = getattr(pool, key)
        data[role] = section
    data["decode"]["num_speculative_tokens"] = best.decode.num_speculative_tokens
    if weight_dtype is not None and weight_dtype != best.model.resolved_weight_dtype(best.hardware.spec):
        data["model"] = {**(data.get("model") or {}), "weight_dtype": weight_dtype}
    data["name"] = f"{data.get('name', 'plan')}-plan"
    comments = "".join(f"# {line}\n" if line else "#\n" for line in header.splitlines())
    return comments + yaml.safe_dump(data, sort_keys=False)
