"""Cross-section rules of a topology: what needs several sections or the model's `config.json`.

Each rule yields an `Issue` at the key path it concerns; a section with a problem of its own is None and
its rules are skipped.
"""

from __future__ import annotations

import dataclasses
import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pdcluster.config.autoscale import autoscale_issues
from pdcluster.config.issues import Issue
from pdcluster.config.quality import quality_issues
from pdcluster.config.schema import (
    EIGHT_BIT_WEIGHT_DTYPES,
    ROLES,
    TLS_FILE_KEYS,
    DecodePoolConfig,
    HardwareConfig,
    InterconnectConfig,
    KVTransferConfig,
    ModelConfig,
    PoolConfig,
    PrefillPoolConfig,
    Topology,
)
from pdcluster.models.config import DeepseekV3Config


def read_model_architecture(model: ModelConfig) -> DeepseekV3Config:
    """The architecture `config.json` of `model`; ValueError naming the file if unreadable or invalid."""
    path = model.config_json
    hint = ""
    if model.path is None and model.config_path is None:
        hint = " (the bundled checkpoint is written by `python -m pdcluster.models.train_tiny`)"
    elif model.config_path is None:
        hint = (
            " (check model.path: a checkpoint directory holding config.json; to plan without the"
            " checkpoint, set model.config_path to a copy of its config.json)"
        )
    try:
        return DeepseekV3Config.from_json_file(path)
    except FileNotFoundError:
        raise ValueError(f"no config.json at {path}{hint}") from None
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror}{hint}") from None


def _divides(a: int, b: int) -> bool:
    return a > 0 and b % a == 0


def _pool_issues(
    role: str, pool: PoolConfig, hw: HardwareConfig | None, arch: DeepseekV3Config | None, arch_src: str
) -> Iterator[Issue]:
    def at(key: str, reason: str) -> Issue:
        return Issue((role, key), f"{role}.{key}: {reason}")

    d = pool.devices_per_instance
    if not _divides(pool.tensor_parallel_size, d):
        yield at(
            "tensor_parallel_size",
            f"{pool.tensor_parallel_size} does not divide devices_per_instance {d} "
            "(attention runs tensor-parallel x data-parallel over the instance's devices)",
        )
    if not _divides(pool.expert_parallel_size, d):
        yield at(
            "expert_parallel_size",
            f"{pool.expert_parallel_size} does not divide devices_per_instance {d} "
            "(experts are split over expert_parallel_size devices, each expert over the rest)",
        )
    if pool.num_redundant_experts and pool.expert_parallel_size == 1:
        yield at("num_redundant_experts", "redundant experts need expert_parallel_size > 1")
    if pool.eplb_interval_steps is not None and pool.expert_parallel_size == 1:
        yield at("eplb_interval_steps", "rebalancing experts (EPLB) needs expert_parallel_size > 1")

    if hw is not None:
        spec = hw.spec
        dpn = hw.devices_per_node
        if not pool.span_nodes and d > dpn:
            yield at(
                "devices_per_instance",
                f"{d} devices do not fit in one node (hardware.devices_per_node is {dpn}); "
                "set span_nodes: true to run an instance over whole nodes",
            )
        elif pool.span_nodes and d % dpn:
            yield at(
                "devices_per_instance",
                f"{d} is not a whole number of nodes of {dpn} devices (span_nodes: true takes whole nodes)",
            )
        elif pool.span_nodes and hw.nodes_per_supernode is not None and d // dpn > hw.nodes_per_supernode:
            yield at(
                "devices_per_instance",
                f"{d} devices need {d // dpn} nodes, more than one supernode "
                f"(hardware.nodes_per_supernode is {hw.nodes_per_supernode})",
            )
        if pool.kv_cache_memory_bytes >= spec.hbm_bytes:
            yield at(
                "kv_cache_memory_bytes",
                f"{pool.kv_cache_memory_bytes} bytes per device leave nothing of the {spec.hbm_bytes} bytes "
                f"of one {spec.name} device for weights and activations",
            )

    if arch is None:
        return
    if not _divides(pool.tensor_parallel_size, arch.num_attention_heads):
        yield at(
            "tensor_parallel_size",
            f"{pool.tensor_parallel_size} does not divide the model's {arch.num_attention_heads} attention "
            f"heads (num_attention_heads in {arch_src})",
        )
    num_experts = arch.n_routed_experts + pool.num_redundant_experts
    if pool.expert_parallel_size > 1 and arch.n_routed_experts == 0:
        yield at("expert_parallel_size", f"the model has no routed experts (n_routed_experts in {arch_src})")
    elif not _divides(pool.expert_parallel_size, num_experts):
        yield at(
            "expert_parallel_size",
            f"{pool.expert_parallel_size} does not divide the model's {arch.n_routed_experts} routed experts "
            f"+ {pool.num_redundant_experts} redundant (n_routed_experts in {arch_src})",
        )
    elif _divides(pool.expert_parallel_size, d) and not _divides(
        pool.moe_tensor_parallel_size, arch.moe_intermediate_size
    ):
        yield at(
            "expert_parallel_size",
            f"each expert would be split over {pool.moe_tensor_parallel_size} devices, which does not divide "
            f"moe_intermediate_size {arch.moe_intermediate_size} ({arch_src})",
        )
    if pool.max_model_len is not None and pool.max_model_len > arch.max_position_embeddings:
        yield at(
            "max_model_len",
            f"{pool.max_model_len} exceeds the model's max_position_embeddings "
            f"{arch.max_position_embeddings} ({arch_src})",
        )


def _device_memory_issue(
    role: str, pool: PoolConfig, hw: HardwareConfig, model: ModelConfig, arch: DeepseekV3Config
) -> Iterator[Issue]:
    """One device's parameters (in `weight_dtype`) plus `kv_cache_memory_bytes` must fit its `hbm_bytes`."""
    from pdcluster.planner.memory import pool_memory_overflow  # lazily: the planner imports this package

    weight_dtype = model.resolved_weight_dtype(hw.spec)
    overflow = pool_memory_overflow(arch, pool, hw.spec, weight_dtype)
    if overflow is None:
        return
    fixes = ["more expert parallelism (larger devices_per_instance and expert_parallel_size)"]
    fixes.append("a smaller kv_cache_memory_bytes")
    if weight_dtype not in EIGHT_BIT_WEIGHT_DTYPES:
        fixes.append(f"8-bit weights (model.weight_dtype: {' or '.join(EIGHT_BIT_WEIGHT_DTYPES)})")
    yield Issue(
        (role,),
        f"{role}: weights + KV cache do not fit one device {overflow}; use {', '.join(fixes[:-1])}, or "
        f"{fixes[-1]}",
    )


def _max_model_len_issues(
    prefill: PoolConfig, decode: PoolConfig, arch: DeepseekV3Config | None, arch_src: str
) -> Iterator[Issue]:
    """Prefill and decode must agree on `max_model_len` (null: `max_position_embeddings`)."""
    if prefill.max_model_len is None and decode.max_model_len is None:
        return
    limit = arch.max_position_embeddings if arch is not None else None
    lengths = {}
    for role, pool in (("prefill", prefill), ("decode", decode)):
        value = pool.max_model_len if pool.max_model_len is not None else limit
        if value is None or (limit is not None and value > limit):
            return
        lengths[role] = value
    if lengths["prefill"] == lengths["decode"]:
        return

    def describe(role: str, pool: PoolConfig) -> str:
        if pool.max_model_len is None:
            return f"{role}.max_model_len null (the model's max_position_embeddings {limit}, {arch_src})"
        return f"{role}.max_model_len {pool.max_model_len}"

    role = "decode" if decode.max_model_len is not None else "prefill"
    yield Issue(
        (role, "max_model_len"),
        f"{role}.max_model_len: {describe('prefill', prefill)} and {describe('decode', decode)} differ; a "
        "request prefilled on one pool must fit the other, so set both to the same value (the smaller one "
        f"is {min(lengths.values())})",
    )


def _hardware_issues(hw: HardwareConfig, ic: InterconnectConfig | None) -> Iterator[Issue]:
    dies = hw.spec.dies_per_chip
    if hw.devices_per_node % dies:
        yield Issue(
            ("hardware", "devices_per_node"),
            f"hardware.devices_per_node: {hw.devices_per_node} is not a whole number of "
            f"{hw.accelerator} packages ({dies} dies each; a device is one die)",
        )
    if hw.nodes_per_supernode is not None and hw.num_nodes % hw.nodes_per_supernode:
        yield Issue(
            ("hardware", "nodes_per_supernode"),
            f"hardware.nodes_per_supernode: {hw.nodes_per_supernode} does not divide num_nodes "
            f"{hw.num_nodes}",
        )
    if ic is not None and (hw.nodes_per_supernode is None) != (ic.supernode is None):
        if ic.supernode is None:
            yield Issue(
                ("hardware", "nodes_per_supernode"),
                "hardware.nodes_per_supernode: supernodes need an interconnect.supernode link",
            )
        else:
            yield Issue(
                ("interconnect", "supernode"),
                "interconnect.supernode: a supernode link needs hardware.nodes_per_supernode",
            )


def _pem_file_problem(path: str, marker: str) -> str | None:
    file = Path(path)
    if not file.is_file():  # also keeps a FIFO or a directory from being opened
        return f"{path} is not a file" if file.exists() else f"{path} does not exist"
    try:
        text = file.read_bytes()
    except OSError as exc:
        return f"cannot read {path}: {exc.strerror or exc}"
    if b"-----BEGIN " not in text or marker.encode() not in text:
        return f"{path} is not a PEM file with a {marker}"
    return None


def _tls_issues(kv: KVTransferConfig) -> Iterator[Issue]:
    tls = kv.tls
    assert tls is not None
    if kv.transport == "torch_distributed":
        yield Issue(
            ("kv_transfer", "tls"),
            f"kv_transfer.tls: TLS is for the grpc transport; {kv.transport}'s backends (gloo, NCCL, HCCL) "
            "have none (remove tls, or use transport: grpc)",
        )
    elif kv.transport == "shm":
        yield Issue(
            ("kv_transfer", "tls"),
            "kv_transfer.tls: TLS is for the grpc transport; shm never leaves the host (its socket is the "
            "user's own; remove tls, or use transport: grpc or auto)",
        )
    markers = {"cert_file": "CERTIFICATE", "key_file": "PRIVATE KEY", "ca_file": "CERTIFICATE"}
    problems = {key: _pem_file_problem(getattr(tls, key), markers[key]) for key in TLS_FILE_KEYS}
    for key, problem in problems.items():
        if problem is not None:
            yield Issue(("kv_transfer", "tls", key), f"kv_transfer.tls.{key}: {problem}")
    if any(problems.values()):
        return
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        context.load_cert_chain(tls.cert_file, tls.key_file, password=lambda: b"")
    except ssl.SSLError as exc:
        yield Issue(
            ("kv_transfer", "tls", "key_file"),
            f"kv_transfer.tls.key_file: {tls.key_file} and cert_file {tls.cert_file} do not load as a "
            f"certificate and its unencrypted private key ({exc.reason or exc})",
        )
    try:
        context.load_verify_locations(cafile=tls.ca_file)
    except ssl.SSLError as exc:
        yield Issue(
            ("kv_transfer", "tls", "ca_file"), f"kv_transfer.tls.ca_file: {tls.ca_file}: {exc.reason or exc}"
        )


def cross_section_issues(
    sections: dict[str, Any], arch: DeepseekV3Config | None, arch_src: str, *, device_memory: bool = True
) -> Iterator[Issue]:
    """Rules over several sections; `device_memory` also checks each pool fits one device."""
    from pdcluster.config.placement import PlacementError, assign_devices

    hw: HardwareConfig | None = sections.get("hardware")
    model: ModelConfig | None = sections.get("model")
    ic: InterconnectConfig | None = sections.get("interconnect")
    prefill: PrefillPoolConfig | None = sections.get("prefill")
    decode: DecodePoolConfig | None = sections.get("decode")

    hw_issues: list[Issue] = []
    if hw is not None:
        hw_issues = list(_hardware_issues(hw, ic))
        yield from hw_issues

    pools: list[tuple[str, PoolConfig]] = [(r, p) for r, p in (("prefill", prefill), ("decode", decode)) if p]
    pool_ok = {}
    for role, pool in pools:
        issues = list(_pool_issues(role, pool, hw, arch, arch_src))
        pool_ok[role] = not any(i.path[1] != "max_model_len" for i in issues)
        yield from issues
        if device_memory and pool_ok[role] and hw is not None and model is not None and arch is not None:
            yield from _device_memory_issue(role, pool, hw, model, arch)

    if prefill is not None and decode is not None:
        yield from _max_model_len_issues(prefill, decode, arch, arch_src)

    if decode is not None and arch is not None and decode.num_speculative_tokens > 0:
        if arch.num_nextn_predict_layers < 1:
            yield Issue(
                ("decode", "num_speculative_tokens"),
                f"decode.num_speculative_tokens: {decode.num_speculative_tokens} needs an MTP module, but "
                f"the model has none (num_nextn_predict_layers is 0 in {arch_src})",
            )
    num_layers = None if arch is None else arch.num_hidden_layers + arch.num_nextn_predict_layers
    yield from quality_issues(sections, num_layers)
    yield from autoscale_issues(sections)
    kv: KVTransferConfig | None = sections.get("kv_transfer")
    if kv is not None and kv.tls is not None:
        yield from _tls_issues(kv)
    if kv is not None and hw is not None and kv.transport == "shm" and hw.num_nodes != 1:
        yield Issue(
            ("kv_transfer", "transport"),
            f"kv_transfer.transport: shm moves KV through one host's shared memory, but hardware.num_nodes "
            f"is {hw.num_nodes} (use auto or grpc)",
        )
    router = sections.get("router")
    if router is not None and prefill is not None and router.policy == "prefix_aware":
        if not prefill.enable_prefix_caching:
            yield Issue(
                ("router", "policy"),
                "router.policy: prefix_aware routes by prefix-cache hits, but prefill.enable_prefix_caching "
                "is false",
            )

    if hw is None or hw_issues or prefill is None or decode is None:
        return
    if not all(pool_ok.get(r, False) for r in ROLES):
        return
    capacity = hw.num_devices
    demand = 0
    for role, pool in (("prefill", prefill), ("decode", decode)):
        demand += pool.num_devices
        if demand > capacity:
            yield Issue(
                (role, "num_instances"),
                f"{role}.num_instances: the pools need "
                f"{prefill.num_instances}×{prefill.devices_per_instance} (prefill) + "
                f"{decode.num_instances}×{decode.devices_per_instance} (decode) = "
                f"{prefill.num_devices + decode.num_devices} devices, but the hardware has "
                f"{hw.num_nodes} node(s) × {hw.devices_per_node} = {capacity}",
            )
            return
    try:
        assign_devices(hw, [("prefill", prefill), ("decode", decode)])
    except PlacementError as exc:
        yield Issue((exc.role, "devices_per_instance"), f"{exc.role}.devices_per_instance: {exc}")


def check_topology(topology: Topology) -> list[Issue]:
    """Every cross-section problem of a topology built in code (reads the model's config.json)."""
    sections = {f.name: getattr(topology, f.name) for f in dataclasses.fields(topology)}
    try:
        arch = read_model_architecture(topology.model)
    except ValueError as exc:
        return [Issue(("model", "path"), f"model: {exc}"), *cross_section_issues(sections, None, "")]
    return list(cross_section_issues(sections, arch, str(topology.model.config_json)))
