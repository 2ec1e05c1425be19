"""Cluster topology: the YAML schema as frozen dataclasses, and its pre-flight validation.

One YAML file (see `clusters/README.md` for every key) describes the hardware, the links between devices,
the model, the prefill and decode pools, KV transfer, routing, SLOs and the HTTP API. YAML keys equal
field names. `load_topology(path)` reads it with line numbers and checks it before anything starts;
every problem found is reported at once, one `FILE:LINE: reason` per line, in a `TopologyError`.

Vocabulary:
  device    what Ray and torch schedule as one unit: a GPU, an Ascend NPU *die* (a 910C package has two),
            or for `cpu` one CPU worker slot.
  instance  one engine (a prefill or a decode node) over `devices_per_instance` devices. Attention runs
            tensor-parallel over `tensor_parallel_size` devices and data-parallel over the rest;
            routed experts are split over `expert_parallel_size` devices and each expert's FFN over the
            rest (`moe_tensor_parallel_size`).

Validation happens in two layers: each dataclass checks its own fields (type, choice, range) on
construction, so one built in code is checked too; `check_topology` checks what needs several sections
and the model's `config.json` (divisibility, MTP, device counts, placement).
"""

from __future__ import annotations

import dataclasses
import difflib
import ipaddress
import math
import os
import re
import ssl
import stat
import types
import typing
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import yaml

from engine.config import KV_CACHE_DTYPES, EngineConfig
from models import bundled_checkpoint_dir
from models.config import DeepseekV3Config
from models.dtypes import MODEL_DTYPE_NAMES
from orchestrator.hardware import ACCELERATORS, AcceleratorSpec

DEFAULT_TOPOLOGY_PATH = Path(__file__).resolve().parent.parent / "clusters" / "local.yaml"

ROLES = ("prefill", "decode")
MODEL_DTYPES = ("auto", *MODEL_DTYPE_NAMES)
KV_TRANSPORTS = ("grpc", "torch_distributed")
WIRE_DTYPES = ("auto", "int8")
# The router module implements one pure function per name (written with the router; keep in sync).
ROUTER_POLICIES = ("round_robin", "least_loaded", "prefix_aware")

MIB = 1024**2
DEFAULT_MAX_REQUEST_BODY_BYTES = 4 * MIB  # api.max_request_body_bytes
# api.max_concurrent_requests when null, per decode seat (decode.num_instances x decode.max_num_seqs):
# one batch running on each decode instance and as many again prefilling or waiting for a seat.
CONCURRENT_REQUESTS_PER_DECODE_SEAT = 2

# Bounds on a topology file, far above any real one (the shipped files are under 10 KB, 4 levels deep and a
# few hundred YAML nodes) and low enough that reading one cannot exhaust memory or the interpreter's stack.
MAX_YAML_BYTES = 1 * MIB
MAX_YAML_DEPTH = 32  # nesting levels of mappings and lists, aliases and merge keys expanded
MAX_YAML_NODES = 100_000  # YAML nodes with every alias expanded (a "billion laughs" file is refused)


# ---- field checks shared by __post_init__ and the YAML loader -----------------------------------------
def _choices(*values: str) -> dict[str, Any]:
    return {"choices": values}


def _at_least(bound: float) -> dict[str, Any]:
    return {"min": bound}


def _above(bound: float) -> dict[str, Any]:
    return {"gt": bound}


def _between(low: float, high: float) -> dict[str, Any]:
    return {"min": low, "max": high}


def _above_at_most(low: float, high: float) -> dict[str, Any]:
    return {"gt": low, "max": high}


# Upper bounds of the integer fields: far above any real deployment, low enough that a typo (`1e29`) is an
# error at its line instead of a plan or an allocation nobody meant. Every int field has one.
MAX_NODES = 65_536
MAX_DEVICES_PER_NODE = 1_024
MAX_DEVICES = MAX_NODES * MAX_DEVICES_PER_NODE  # 2**26
MAX_INSTANCES = 65_536
MAX_TOKENS = 2**26  # a step's token budget, a context length
MAX_SEQS = 2**20
MAX_BLOCK_SIZE = 65_536
MAX_KV_CACHE_BYTES = 2**50  # 1 PiB per device; the rule against the device's memory is tighter
MAX_SPECULATIVE_TOKENS = 64
MAX_CPUS_PER_DEVICE = 1_024
MAX_TIMEOUT_S = 86_400.0  # one day


def _shown(value: Any) -> str:
    """`value` for a message: integers of more than 15 digits in scientific notation (`1e+29`)."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**15:
        return f"{value:.3g}"
    return repr(value)


def _unwrap_optional(hint: Any) -> tuple[Any, bool]:
    """`X | None` -> (X, True); anything else -> (hint, False)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(hint)) == 2:
            return args[0], True
    return hint, False


_TYPE_NAMES = {bool: "a boolean (true/false)", int: "an integer", float: "a number", str: "a string"}


def _value_problem(f: dataclasses.Field, hint: Any, value: Any) -> str | None:
    """Why `value` is not acceptable for field `f` (type, choices, bounds), or None."""
    base, optional = _unwrap_optional(hint)
    if value is None:
        return None if optional else "must not be null"
    if dataclasses.is_dataclass(base):
        return None if isinstance(value, base) else f"expected a {base.__name__}"
    if base is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    elif base is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, base)
    if not ok:
        return f"expected {_TYPE_NAMES.get(base, base.__name__)}, got {value!r}"
    meta = f.metadata
    if "choices" in meta and value not in meta["choices"]:
        return f"{value!r} is not one of: {', '.join(meta['choices'])}"
    if "min" in meta and value < meta["min"]:
        return f"must be >= {meta['min']}, got {_shown(value)}"
    if "gt" in meta and not value > meta["gt"]:
        return f"must be > {meta['gt']}, got {_shown(value)}"
    if "max" in meta and value > meta["max"]:
        return f"must be <= {meta['max']}, got {_shown(value)}"
    if "check" in meta:
        return meta["check"](value)
    return None


def _check_fields(obj: Any) -> None:
    """Raise ValueError naming the first field of dataclass `obj` with an unacceptable value."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        problem = _value_problem(f, hints[f.name], getattr(obj, f.name))
        if problem is not None:
            raise ValueError(f"{type(obj).__name__} field {f.name!r}: {problem}")


# ---- the schema ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LinkConfig:
    """One level of the interconnect, per device and per direction.

    Attributes:
        bandwidth_bytes_per_s: bytes per second one device can send over this level.
        latency_s: one small message's one-way latency.
    """

    bandwidth_bytes_per_s: float = field(metadata=_above(0))
    latency_s: float = field(metadata=_at_least(0))

    def __post_init__(self) -> None:
        _check_fields(self)


@dataclass(frozen=True)
class InterconnectConfig:
    """Links between devices, from the closest level to the farthest.

    `die_to_die`: between the dies of one package (None: single-die accelerators). `intra_node`: between
    devices of one node. `supernode`: between nodes of one supernode (e.g. Huawei's Unified Bus); None when
    `hardware.nodes_per_supernode` is. `inter_node`: between nodes that share no supernode (e.g. RoCE).
    The defaults describe a commodity machine (process-to-process copies; 100 Gb/s Ethernet); files for
    real clusters set every level.
    """

    die_to_die: LinkConfig | None = None
    intra_node: LinkConfig = field(default_factory=lambda: LinkConfig(10e9, 5e-6))
    supernode: LinkConfig | None = None
    inter_node: LinkConfig = field(default_factory=lambda: LinkConfig(12.5e9, 10e-6))

    def __post_init__(self) -> None:
        _check_fields(self)


@dataclass(frozen=True)
class HardwareConfig:
    """The machines.

    Attributes:
        accelerator: a key of `orchestrator.hardware.ACCELERATORS`.
        num_nodes: machines in the cluster.
        devices_per_node: devices (GPUs, NPU dies, CPU worker slots) per machine.
        nodes_per_supernode: nodes per supernode (a group with its own fast fabric); None for no grouping.
        cpus_per_device: CPU cores reserved in Ray next to each device.
    """

    accelerator: str = field(default="cpu", metadata=_choices(*ACCELERATORS))
    num_nodes: int = field(default=1, metadata=_between(1, MAX_NODES))
    devices_per_node: int = field(default=2, metadata=_between(1, MAX_DEVICES_PER_NODE))
    nodes_per_supernode: int | None = field(default=None, metadata=_between(1, MAX_NODES))
    cpus_per_device: float = field(default=1.0, metadata=_above_at_most(0, MAX_CPUS_PER_DEVICE))

    def __post_init__(self) -> None:
        _check_fields(self)

    @property
    def spec(self) -> AcceleratorSpec:
        return ACCELERATORS[self.accelerator]

    @property
    def num_devices(self) -> int:
        return self.num_nodes * self.devices_per_node


@dataclass(frozen=True)
class ModelConfig:
    """The checkpoint every instance serves.

    Attributes:
        path: Hugging Face-format checkpoint directory as the nodes see it; None is the bundled tiny
            checkpoint (`models.bundled_checkpoint_dir()`). Relative paths are relative to the YAML file.
        config_path: a copy of the checkpoint's `config.json` to validate against when `path` is not
            readable where validation runs (a cluster's shared storage); None reads `<path>/config.json`.
        dtype: parameter dtype; `auto` is float32 on cpu and bfloat16 on accelerators.
    """

    path: str | None = None
    config_path: str | None = None
    dtype: str = field(default="auto", metadata=_choices(*MODEL_DTYPES))

    def __post_init__(self) -> None:
        _check_fields(self)

    @property
    def checkpoint_dir(self) -> Path:
        return bundled_checkpoint_dir() if self.path is None else Path(self.path)

    @property
    def config_json(self) -> Path:
        """Where validation reads the architecture from."""
        return Path(self.config_path) if self.config_path is not None else self.checkpoint_dir / "config.json"

    def resolved_dtype(self, spec: AcceleratorSpec) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if spec.is_accelerator else "float32"


@dataclass(frozen=True)
class PoolConfig:
    """What the prefill and decode pools share: size, parallelism, and engine arguments per instance.

    Attributes:
        num_instances: engines in the pool.
        devices_per_instance: devices each engine runs on.
        span_nodes: allow an instance larger than a node; it then takes whole nodes
            (`devices_per_instance` a multiple of `devices_per_node`) within one supernode.
        tensor_parallel_size: devices one attention computation is split over (heads split); the rest of
            the instance's devices run attention data-parallel.
        expert_parallel_size: devices the routed experts (plus redundant copies) are split over; each
            expert's FFN is split over the remaining `devices_per_instance / expert_parallel_size`.
        num_redundant_experts: extra copies of hot experts (EPLB) placed with the routed experts.
        block_size: token slots per KV cache block.
        kv_cache_dtype: `auto` (the model dtype) or `int8` (per-token scales).
        kv_cache_memory_bytes: KV cache bytes on each device of an instance.
        max_num_batched_tokens: token budget of one engine step.
        max_num_seqs: requests running at once in one instance.
        max_model_len: context length; None is the model's `max_position_embeddings`.
        enable_prefix_caching: reuse KV of identical prompt prefixes.
    """

    num_instances: int = field(default=1, metadata=_between(1, MAX_INSTANCES))
    devices_per_instance: int = field(default=1, metadata=_between(1, MAX_DEVICES))
    span_nodes: bool = False
    tensor_parallel_size: int = field(default=1, metadata=_between(1, MAX_DEVICES))
    expert_parallel_size: int = field(default=1, metadata=_between(1, MAX_DEVICES))
    num_redundant_experts: int = field(default=0, metadata=_between(0, MAX_INSTANCES))
    block_size: int = field(default=16, metadata=_between(1, MAX_BLOCK_SIZE))
    kv_cache_dtype: str = field(default="auto", metadata=_choices(*KV_CACHE_DTYPES))
    kv_cache_memory_bytes: int = field(default=256 * MIB, metadata=_between(1, MAX_KV_CACHE_BYTES))
    max_num_batched_tokens: int = field(default=2048, metadata=_between(1, MAX_TOKENS))
    max_num_seqs: int = field(default=64, metadata=_between(1, MAX_SEQS))
    max_model_len: int | None = field(default=None, metadata=_between(1, MAX_TOKENS))
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        _check_fields(self)

    @property
    def num_devices(self) -> int:
        """Devices of the whole pool."""
        return self.num_instances * self.devices_per_instance

    @property
    def attention_data_parallel_size(self) -> int:
        return self.devices_per_instance // self.tensor_parallel_size

    @property
    def moe_tensor_parallel_size(self) -> int:
        return self.devices_per_instance // self.expert_parallel_size


@dataclass(frozen=True)
class PrefillPoolConfig(PoolConfig):
    """The prefill pool. `enable_chunked_prefill`: split long prompts over several steps."""

    enable_chunked_prefill: bool = True


@dataclass(frozen=True)
class DecodePoolConfig(PoolConfig):
    """The decode pool.

    Attributes:
        num_speculative_tokens: MTP draft tokens per step, k (0: no speculative decoding). The prefill side
            drafts the first k too, so decode starts at full acceptance.
        adaptive_speculation: vary k in [1, num_speculative_tokens] with the recent acceptance rate.
    """

    num_speculative_tokens: int = field(default=0, metadata=_between(0, MAX_SPECULATIVE_TOKENS))
    adaptive_speculation: bool = False


@dataclass(frozen=True)
class KVTLSConfig:
    """Mutual TLS on the gRPC KV channel: every decode server and prefill sender presents `cert_file`, and
    accepts a peer only with a certificate `ca_file` signed. The driver reads the files at deploy and gives
    their contents to the actors over Ray, so they need to be readable where `pdcluster deploy` runs.

    Attributes:
        cert_file: PEM certificate (chain) of the cluster's KV endpoints, for server and client use.
        key_file: PEM private key of `cert_file` (unencrypted).
        ca_file: PEM certificate(s) of the CA that signs the endpoints' certificates.
        server_name: the name senders check the decode certificate against (its subjectAltName) instead of
            the address they dial, which is an IP address; None: the dialled address.
    Relative paths are relative to the YAML file's directory.
    """

    cert_file: str
    key_file: str
    ca_file: str
    server_name: str | None = None

    def __post_init__(self) -> None:
        _check_fields(self)
        for name in ("cert_file", "key_file", "ca_file"):
            if not getattr(self, name):
                raise ValueError(f"KVTLSConfig field {name!r}: must not be empty")


TLS_FILE_KEYS = ("cert_file", "key_file", "ca_file")


@dataclass(frozen=True)
class KVTransferConfig:
    """Prefill -> decode KV handoff.

    Attributes:
        transport: `grpc` (streaming, any network) or `torch_distributed` (P2P over the accelerator's
            collective backend: HCCL, NCCL or gloo).
        layerwise: send each layer's KV as soon as it is computed (False: once the prompt is done).
        wire_dtype: `auto` (the cache dtype) or `int8` (quantized on the wire, per-token scales).
        timeout_s: a transfer not complete after this long is abandoned and the request re-dispatched.
        tls: mutual TLS for the grpc transport; None: plaintext (each handoff is still bound to its
            reservation by a per-handoff secret, see `kvtransfer.base`).
    """

    transport: str = field(default="grpc", metadata=_choices(*KV_TRANSPORTS))
    layerwise: bool = True
    wire_dtype: str = field(default="auto", metadata=_choices(*WIRE_DTYPES))
    timeout_s: float = field(default=30.0, metadata=_above_at_most(0, MAX_TIMEOUT_S))
    tls: KVTLSConfig | None = None

    def __post_init__(self) -> None:
        _check_fields(self)


@dataclass(frozen=True)
class RouterConfig:
    """`policy`: how the router picks instances: round_robin, least_loaded or prefix_aware."""

    policy: str = field(default="least_loaded", metadata=_choices(*ROUTER_POLICIES))

    def __post_init__(self) -> None:
        _check_fields(self)


@dataclass(frozen=True)
class SLOConfig:
    """Latency targets (None: no target): time to first token and time per output token."""

    ttft_ms: float | None = field(default=None, metadata=_above(0))
    tpot_ms: float | None = field(default=None, metadata=_above(0))

    def __post_init__(self) -> None:
        _check_fields(self)


_DNS_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")


def host_problem(host: str) -> str | None:
    """Why `host` cannot be what the HTTP server binds, or None. Purely syntactic (nothing is resolved).

    Accepted: an IPv4 address (`0.0.0.0` for every interface), `localhost`, or a host name of dot-separated
    DNS labels (letters, digits, inner hyphens; 1-63 characters each, 253 in all). A name whose last label is
    all digits is taken as a mistyped IPv4 address (`256.1.1.1`). IPv6 addresses are refused: the server
    binds an IPv4 socket.
    """
    if not host:
        return "must not be empty (127.0.0.1: this machine only; 0.0.0.0: every interface)"
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        pass
    else:
        if address.version == 6:
            return f"{host!r}: IPv6 addresses are not supported (the HTTP server binds an IPv4 socket)"
        return None
    labels = host.removesuffix(".").split(".")
    if len(host) > 253 or not all(_DNS_LABEL.fullmatch(label) for label in labels):
        return (
            f"{host!r} is neither an IPv4 address nor a host name (dot-separated labels of letters, digits "
            "and inner hyphens, 1-63 characters each)"
        )
    if labels[-1].isdigit():
        return f"{host!r} is not a valid IPv4 address (each of its 4 numbers is 0-255)"
    return None


def api_key_problem(key: str) -> str | None:
    """Why `key` cannot be the API's bearer token, or None: empty (null means no authentication), or a
    character a client cannot send in `Authorization: Bearer KEY` and have compared as written."""
    if not key:
        return "must not be empty (null: no authentication)"
    if not all("!" <= c <= "~" for c in key):
        return "must be printable ASCII without spaces (it is sent as `Authorization: Bearer KEY`)"
    return None


@dataclass(frozen=True)
class ApiConfig:
    """The OpenAI-compatible HTTP endpoint (`orchestrator.api_server`).

    Attributes:
        host: the IPv4 address or host name the server binds (`host_problem` says what is accepted).
        port: TCP port; 0 picks a free one.
        api_key: bearer token clients must send; None: no authentication; never empty.
        max_request_body_bytes: bytes of one request body at most (the JSON, headers excluded); a larger
            one is answered 413 without being read. The default holds a 128K-token prompt as token ids.
        max_concurrent_requests: completion requests in flight at the edge at most (from the request line
            until the response ends); beyond it a request is answered 429 with `Retry-After` before its
            stream starts. None: `CONCURRENT_REQUESTS_PER_DECODE_SEAT` per decode seat
            (`Topology.max_concurrent_requests`).
    """

    host: str = field(default="127.0.0.1", metadata={"check": host_problem})
    port: int = field(default=8000, metadata=_between(0, 65535))
    api_key: str | None = field(default=None, metadata={"check": api_key_problem})
    max_request_body_bytes: int = field(
        default=DEFAULT_MAX_REQUEST_BODY_BYTES, metadata=_between(1024, 1 << 30)
    )
    max_concurrent_requests: int | None = field(default=None, metadata=_between(1, 1_000_000))

    def __post_init__(self) -> None:
        _check_fields(self)


@dataclass(frozen=True)
class Topology:
    """A whole cluster description; the root of the YAML file."""

    name: str
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    interconnect: InterconnectConfig = field(default_factory=InterconnectConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    prefill: PrefillPoolConfig = field(default_factory=PrefillPoolConfig)
    decode: DecodePoolConfig = field(default_factory=DecodePoolConfig)
    kv_transfer: KVTransferConfig = field(default_factory=KVTransferConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    slo: SLOConfig = field(default_factory=SLOConfig)
    api: ApiConfig = field(default_factory=ApiConfig)

    def __post_init__(self) -> None:
        _check_fields(self)
        if not self.name:
            raise ValueError("Topology field 'name': must not be empty")

    @property
    def max_concurrent_requests(self) -> int:
        """Completion requests the HTTP edge lets in at once: `api.max_concurrent_requests`, or when that
        is null `CONCURRENT_REQUESTS_PER_DECODE_SEAT` x decode.num_instances x decode.max_num_seqs."""
        if self.api.max_concurrent_requests is not None:
            return self.api.max_concurrent_requests
        return CONCURRENT_REQUESTS_PER_DECODE_SEAT * self.decode.num_instances * self.decode.max_num_seqs

    def pool(self, role: str) -> PoolConfig:
        """The `prefill` or `decode` pool."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        return self.prefill if role == "prefill" else self.decode

    def engine_config(self, role: str) -> EngineConfig:
        """Engine arguments for one instance of pool `role` (the device index is the actor's to add).

        Prefill instances get decode's `num_speculative_tokens`: they draft the first MTP tokens that
        travel with the KV. `kv_cache_memory_bytes` is per device.
        """
        pool = self.pool(role)
        spec = self.hardware.spec
        return EngineConfig(
            model=str(self.model.checkpoint_dir),
            device=spec.torch_device_type,
            dtype=self.model.resolved_dtype(spec),
            block_size=pool.block_size,
            kv_cache_memory_bytes=pool.kv_cache_memory_bytes,
            kv_cache_dtype=pool.kv_cache_dtype,
            max_num_batched_tokens=pool.max_num_batched_tokens,
            max_num_seqs=pool.max_num_seqs,
            max_model_len=pool.max_model_len,
            enable_prefix_caching=pool.enable_prefix_caching,
            enable_chunked_prefill=self.prefill.enable_chunked_prefill if role == "prefill" else True,
            num_speculative_tokens=self.decode.num_speculative_tokens,
            adaptive_speculation=self.decode.adaptive_speculation if role == "decode" else False,
        )

    def summary(self) -> str:
        """One line, e.g. `2 nodes × 8 h200, prefill 1×8 devices, decode 1×8 devices`."""
        hw = self.hardware
        dies = hw.spec.dies_per_chip
        per_node = f"{hw.devices_per_node // dies} {hw.accelerator}"
        if dies > 1:
            per_node += f" ({hw.devices_per_node} dies each)"
        nodes = f"{hw.num_nodes} node{'s' if hw.num_nodes != 1 else ''}"
        pools = ", ".join(
            f"{role} {p.num_instances}×{p.devices_per_instance} devices"
            for role, p in (("prefill", self.prefill), ("decode", self.decode))
        )
        return f"{nodes} × {per_node}, {pools}"


# ---- cross-section rules ----------------------------------------------------------------------------
KeyPath = tuple[str, ...]  # a key path in the YAML file, e.g. ("decode", "expert_parallel_size")


class Issue(NamedTuple):
    """One problem: where (a YAML key path; the loader turns it into a line) and why."""

    path: KeyPath
    reason: str


def read_model_architecture(model: ModelConfig) -> DeepseekV3Config:
    """The architecture `config.json` of `model` (see `ModelConfig.config_json`).

    Raises:
        ValueError: unreadable or invalid; the message says which file and how to fix it.
    """
    path = model.config_json
    hint = ""
    if model.path is None and model.config_path is None:
        hint = " (the bundled checkpoint is written by `python -m models.train_tiny`)"
    elif model.config_path is None:
        hint = " (set model.config_path to a local copy of the checkpoint's config.json)"
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


def _max_model_len_issues(
    prefill: PoolConfig, decode: PoolConfig, arch: DeepseekV3Config | None, arch_src: str
) -> Iterator[Issue]:
    """Prefill and decode must agree on the context length: a prompt prefill accepts must fit decode, and
    the HTTP edge checks requests against one `max_model_len`. A null side means the model's
    `max_position_embeddings` (compared only when the model's config.json was read)."""
    if prefill.max_model_len is None and decode.max_model_len is None:
        return
    limit = arch.max_position_embeddings if arch is not None else None
    lengths = {}
    for role, pool in (("prefill", prefill), ("decode", decode)):
        value = pool.max_model_len if pool.max_model_len is not None else limit
        if value is None or (limit is not None and value > limit):
            return  # unknown, or already reported as over max_position_embeddings
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
    """Why `path` is not a readable PEM file holding a `-----BEGIN ...{marker}-----` block, or None."""
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
    """The TLS files exist, are PEM, the key matches the certificate and the CA file loads."""
    tls = kv.tls
    assert tls is not None
    if kv.transport != "grpc":
        yield Issue(
            ("kv_transfer", "tls"),
            f"kv_transfer.tls: TLS is for the grpc transport; {kv.transport}'s backends (gloo, NCCL, HCCL) "
            "have none (remove tls, or use transport: grpc)",
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


def _cross_issues(sections: dict[str, Any], arch: DeepseekV3Config | None, arch_src: str) -> Iterator[Issue]:
    """Rules over several sections; a section that failed its own checks is None and its rules are skipped."""
    from orchestrator.placement import PlacementError, assign_devices

    hw: HardwareConfig | None = sections.get("hardware")
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

    if prefill is not None and decode is not None:
        yield from _max_model_len_issues(prefill, decode, arch, arch_src)

    if decode is not None and arch is not None and decode.num_speculative_tokens > 0:
        if arch.num_nextn_predict_layers < 1:
            yield Issue(
                ("decode", "num_speculative_tokens"),
                f"decode.num_speculative_tokens: {decode.num_speculative_tokens} needs an MTP module, but "
                f"the model has none (num_nextn_predict_layers is 0 in {arch_src})",
            )
    kv: KVTransferConfig | None = sections.get("kv_transfer")
    if kv is not None and kv.tls is not None:
        yield from _tls_issues(kv)
    router = sections.get("router")
    if router is not None and prefill is not None and router.policy == "prefix_aware":
        if not prefill.enable_prefix_caching:
            yield Issue(
                ("router", "policy"),
                "router.policy: prefix_aware routes by prefix-cache hits, but prefill.enable_prefix_caching "
                "is false",
            )

    # Device counts and placement, once both pools and the hardware are individually sound.
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
        return [Issue(("model", "path"), f"model: {exc}"), *_cross_issues(sections, None, "")]
    return list(_cross_issues(sections, arch, str(topology.model.config_json)))


# ---- YAML loading with line numbers ------------------------------------------------------------------
class TopologyIssue(NamedTuple):
    file: str
    line: int | None  # 1-based; None when the problem has no line (file unreadable)
    reason: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.reason}" if self.line else f"{self.file}: {self.reason}"


def _line_of(lines: Mapping[KeyPath, int], path: KeyPath) -> int:
    """The line of `path`'s key in `lines`, else of its nearest enclosing key that is written, else 1."""
    while path:
        if path in lines:
            return lines[path]
        path = path[:-1]
    return 1


class TopologyError(ValueError):
    """A topology file with problems; the message has one `FILE:LINE: reason` per line, in file order."""

    def __init__(self, issues: list[TopologyIssue]) -> None:
        self.issues = sorted(issues, key=lambda i: i.line or 0)
        super().__init__("\n".join(str(i) for i in self.issues))


class _Reader:
    """Turns composed YAML nodes into dataclasses, recording each key's line and every problem."""

    def __init__(self, loader: yaml.SafeLoader, base_dir: Path) -> None:
        self.loader = loader
        self.base_dir = base_dir
        self.lines: dict[KeyPath, int] = {}
        self.problems: list[tuple[int, str]] = []
        self.broken: set[KeyPath] = set()  # mappings with an unknown, duplicate or missing key

    def error(self, node: yaml.Node, reason: str) -> None:
        self.problems.append((node.start_mark.line + 1, reason))

    def line_of(self, path: KeyPath) -> int:
        """The line of `path`'s key, else of its nearest enclosing key that is written, else 1."""
        return _line_of(self.lines, path)

    def keys(
        self, node: yaml.MappingNode, fields: dict[str, dataclasses.Field], path: KeyPath
    ) -> Iterator[tuple[str, yaml.Node]]:
        """(key, value node) for each known key of `node`; reports unknown and duplicate keys."""
        where = ".".join(path) or "top level"
        self.loader.flatten_mapping(node)  # YAML merge keys (`<<: *anchor`)
        seen: set[str] = set()
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
            if not isinstance(key, str) or key_node.tag != "tag:yaml.org,2002:str":
                self.error(key_node, f"{where}: keys must be plain names, got {_describe(key_node)}")
                self.broken.add(path)
                continue
            if key in seen:
                self.error(key_node, f"{'.'.join((*path, key))}: duplicate key")
                self.broken.add(path)
                continue
            seen.add(key)
            if key not in fields:
                close = difflib.get_close_matches(key, list(fields), n=1, cutoff=0.6)
                hint = f"did you mean {close[0]!r}?" if close else f"valid keys: {', '.join(fields)}"
                self.error(key_node, f"{where}: unknown key {key!r} ({hint})")
                self.broken.add(path)
                continue
            self.lines[(*path, key)] = key_node.start_mark.line + 1
            yield key, value_node
        for f in fields.values():
            required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            if required and f.name not in seen:
                self.error(node, f"{where}: missing required key {f.name!r}")
                self.broken.add(path)

    def section(self, cls: type, node: yaml.Node, path: KeyPath) -> Any | None:
        """Build dataclass `cls` from mapping `node`; None if any of its keys has a problem."""
        where = ".".join(path) or "top level"
        if not isinstance(node, yaml.MappingNode):
            self.error(node, f"{where}: expected a mapping of keys, got {_describe(node)}")
            return None
        hints = typing.get_type_hints(cls)
        fields = {f.name: f for f in dataclasses.fields(cls)}
        kwargs: dict[str, Any] = {}
        ok = True
        for key, value_node in self.keys(node, fields, path):
            good, value = self.value(fields[key], hints[key], value_node, (*path, key))
            if good:
                kwargs[key] = value
            else:
                ok = False
        if not ok or path in self.broken:
            return None
        try:
            return cls(**kwargs)
        except ValueError as exc:  # a rule of the class's own (e.g. an empty name)
            self.error(node, f"{where}: {exc}")
            return None

    def value(self, f: dataclasses.Field, hint: Any, node: yaml.Node, path: KeyPath) -> tuple[bool, Any]:
        name = ".".join(path)
        base, optional = _unwrap_optional(hint)
        if isinstance(node, yaml.ScalarNode) and node.tag == "tag:yaml.org,2002:null":
            if optional:
                return True, None
            if dataclasses.is_dataclass(base):
                self.error(node, f"{name}: expected a mapping of keys, got null (omit the key for defaults)")
            else:
                self.error(node, f"{name}: must not be null")
            return False, None
        if dataclasses.is_dataclass(base):
            result = self.section(base, node, path)
            return result is not None, result
        if not isinstance(node, yaml.ScalarNode):
            expected = _TYPE_NAMES.get(base, base.__name__)
            self.error(node, f"{name}: expected {expected}, got {_describe(node)}")
            return False, None
        try:
            raw = self.loader.construct_object(node, deep=True)
        except (yaml.YAMLError, ValueError, KeyError, TypeError) as exc:  # an explicit tag (`!!int abc`)
            problem = exc.problem if isinstance(exc, yaml.MarkedYAMLError) else str(exc)
            self.error(node, f"{name}: {node.value!r} cannot be read as {node.tag}: {problem}")
            return False, None
        value = _coerce(base, raw, plain=node.style is None)
        problem = _value_problem(f, hint, value)
        if problem is not None:
            self.error(node, f"{name}: {problem}")
            return False, None
        relative_to_file = [("model", "path"), ("model", "config_path")]
        relative_to_file += [("kv_transfer", "tls", key) for key in TLS_FILE_KEYS]
        if path in relative_to_file and not Path(value).is_absolute():
            value = str((self.base_dir / value).resolve())
        return True, value


def _coerce(base: Any, raw: Any, plain: bool) -> Any:
    """Accept what YAML 1.1 reads differently from what a person means; otherwise return `raw` unchanged.

    PyYAML reads `196e9` and `1.6e12` (no dot, or no exponent sign) as strings: for number fields a plain
    (unquoted) numeric string is taken as a number. Integral floats (`64.0e+9`) are accepted as integers.
    """
    if base in (int, float) and isinstance(raw, str) and plain:
        try:
            raw = float(raw.replace("_", ""))
        except ValueError:
            return raw
    if base is int and isinstance(raw, float) and math.isfinite(raw) and raw.is_integer():
        return int(raw)
    if base is float and isinstance(raw, int) and not isinstance(raw, bool):
        return float(raw)
    return raw


def _read_yaml_text(path: Path) -> str:
    """The text of topology file `path`, checked before and while it is opened.

    Raises:
        TopologyError: no such file or unreadable; not a regular file (a FIFO, a device or a directory,
            refused from `os.stat` without opening it, so a FIFO cannot block); larger than
            `MAX_YAML_BYTES`; not valid UTF-8 (the line, the byte and its offset).
    """
    file = str(path)

    def fail(reason: str, line: int | None = None) -> TopologyError:
        return TopologyError([TopologyIssue(file, line, reason)])

    too_large = f"larger than {MAX_YAML_BYTES // MIB} MiB; a topology file is a few KB"
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise fail("not a regular file")
        # O_NONBLOCK: should the path be replaced by a FIFO after the stat, opening it still returns.
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise fail("not a regular file")
            data = f.read(MAX_YAML_BYTES + 1)
    except OSError as exc:
        raise fail(f"cannot read: {exc.strerror or exc}") from None
    if len(data) > MAX_YAML_BYTES:
        raise fail(too_large)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise fail(f"not valid UTF-8 (byte 0x{data[exc.start]:02x} at offset {exc.start})", line) from None


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing to compose nodes nested deeper than `MAX_YAML_DEPTH`.

    PyYAML's composer recurses once per nesting level (50,000 nested brackets end in a RecursionError);
    this raises a `ComposerError` at the first node too deep instead.
    """

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node | None:
        nested = self.check_event(yaml.MappingStartEvent, yaml.SequenceStartEvent)
        if nested and self._depth >= MAX_YAML_DEPTH:
            raise yaml.composer.ComposerError(
                None, None, f"nested deeper than {MAX_YAML_DEPTH} levels", self.peek_event().start_mark
            )
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def _expansion_problem(root: yaml.Node) -> tuple[yaml.Node, str] | None:
    """The first node at which `root`, with every alias expanded, is deeper than `MAX_YAML_DEPTH`, has
    more than `MAX_YAML_NODES` nodes, or contains itself; with the reason. None when it is within bounds.

    Aliases share nodes, so a few lines can stand for billions of nodes (each level aliasing the previous
    one twice), and merge keys (`<<: *a`) copy them when a mapping is read; a chain of merge keys is also
    walked recursively. Sizes are computed once per distinct node, without recursion.
    """
    sizes: dict[int, tuple[int, int]] = {}  # id(node) -> (expanded nodes, expanded depth)
    in_progress: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        if isinstance(node, yaml.MappingNode):
            children = [n for pair in node.value for n in pair]
        elif isinstance(node, yaml.SequenceNode):
            children = list(node.value)
        else:
            children = []
        if not children_done:
            if id(node) in sizes:
                continue
            in_progress.add(id(node))
            stack.append((node, True))
            for child in children:
                if id(child) in in_progress:
                    return child, "an alias refers to a node that contains it (a recursive structure)"
                if id(child) not in sizes:
                    stack.append((child, False))
            continue
        in_progress.discard(id(node))
        size = 1 + sum(sizes[id(c)][0] for c in children)
        depth = 1 + max((sizes[id(c)][1] for c in children), default=0)
        if depth > MAX_YAML_DEPTH:
            return node, f"nested deeper than {MAX_YAML_DEPTH} levels with its aliases expanded"
        if size > MAX_YAML_NODES:
            return node, f"more than {MAX_YAML_NODES:,} YAML nodes with its aliases expanded"
        sizes[id(node)] = (size, depth)
    return None


def _describe(node: yaml.Node) -> str:
    if isinstance(node, yaml.MappingNode):
        return "a mapping"
    if isinstance(node, yaml.SequenceNode):
        return "a list"
    return repr(node.value)


@dataclass(frozen=True)
class LoadedTopology:
    """A valid topology file: its `Topology` and the line of every key written in it, so that rules checked
    later (`orchestrator.preflight`: what `pdcluster deploy` needs) are reported at their lines too.

    Attributes:
        file: the path as given.
        topology: the validated topology.
        key_lines: 1-based line of each key path written in the file.
    """

    file: str
    topology: Topology
    key_lines: Mapping[KeyPath, int]

    def line_of(self, path: KeyPath) -> int | None:
        """The line of `path`'s key, else of its nearest enclosing written key, else 1; None for `()` (an
        issue about no key of the file, e.g. a command-line override)."""
        return _line_of(self.key_lines, path) if path else None

    def locate(self, issues: Iterable[Issue]) -> list[TopologyIssue]:
        """`issues` as `FILE:LINE: reason` issues of this file, in line order."""
        located = [TopologyIssue(self.file, self.line_of(i.path), i.reason) for i in issues]
        return sorted(located, key=lambda i: i.line or 0)


def load_topology(path: str | Path) -> Topology:
    """Read and validate a topology YAML file: `read_topology(path).topology`.

    Raises:
        TopologyError: as `read_topology`.
    """
    return read_topology(path).topology


def read_topology(path: str | Path) -> LoadedTopology:
    """Read and validate a topology YAML file; the topology with the line of each key.

    The file must be a regular file (a FIFO or a device is refused without being opened) of at most
    `MAX_YAML_BYTES`, in UTF-8, nested at most `MAX_YAML_DEPTH` levels and at most `MAX_YAML_NODES` YAML
    nodes with its aliases expanded.

    Raises:
        TopologyError: every problem found, one `FILE:LINE: reason` per line (unknown keys with the
            closest valid key, wrong types, invalid choices, impossible parallelism for the model, more
            devices than the hardware has, an instance that cannot be placed); a file that cannot be read
            as YAML (not a regular file, too large, not UTF-8, a syntax error, too deep) has one issue.
    """
    path = Path(path)
    file = str(path)
    text = _read_yaml_text(path)
    try:
        loader = _BoundedLoader(text)  # checks every character is printable first
    except yaml.reader.ReaderError as exc:
        line = text.count("\n", 0, exc.position) + 1
        reason = f"invalid YAML: character #x{exc.character:04x} at offset {exc.position}: {exc.reason}"
        raise TopologyError([TopologyIssue(file, line, reason)]) from None
    try:
        root = loader.get_single_node()
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark is not None else None
        raise TopologyError([TopologyIssue(file, line, f"invalid YAML: {exc.problem or exc}")]) from None
    except yaml.YAMLError as exc:
        raise TopologyError([TopologyIssue(file, None, f"invalid YAML: {exc}")]) from None
    finally:
        loader.dispose()
    if root is None:
        raise TopologyError([TopologyIssue(file, 1, "empty file; a topology needs at least `name:`")])
    too_big = _expansion_problem(root)
    if too_big is not None:
        node, reason = too_big
        raise TopologyError([TopologyIssue(file, node.start_mark.line + 1, f"invalid YAML: {reason}")])

    reader = _Reader(loader, path.resolve().parent)
    # Each section is read on its own, so one broken section does not hide another's problems; a section
    # with a problem is None in `sections` and the rules that need it are skipped.
    sections: dict[str, Any] = {}
    topology: Topology | None = None
    if isinstance(root, yaml.MappingNode):
        hints = typing.get_type_hints(Topology)
        fields = {f.name: f for f in dataclasses.fields(Topology)}
        for key, value_node in reader.keys(root, fields, ()):
            good, value = reader.value(fields[key], hints[key], value_node, (key,))
            sections[key] = value if good else None
        for name, f in fields.items():  # sections not written: their defaults, checked like the rest
            if name not in sections and f.default_factory is not dataclasses.MISSING:
                sections[name] = f.default_factory()
        if all(v is not None for v in sections.values()) and "name" in sections:
            try:
                topology = Topology(**sections)
            except ValueError as exc:
                reader.problems.append((reader.line_of(("name",)), str(exc)))
    else:
        reader.error(root, f"top level: expected a mapping of keys, got {_describe(root)}")

    model: ModelConfig | None = sections.get("model")
    arch: DeepseekV3Config | None = None
    arch_src = ""
    if model is not None:
        try:
            arch = read_model_architecture(model)
            arch_src = str(model.config_json)
        except ValueError as exc:
            key = "config_path" if model.config_path is not None else "path"
            reader.problems.append((reader.line_of(("model", key)), f"model.{key}: {exc}"))
    if isinstance(root, yaml.MappingNode):
        for issue in _cross_issues(sections, arch, arch_src):
            reader.problems.append((reader.line_of(issue.path), issue.reason))

    if reader.problems or topology is None:
        raise TopologyError([TopologyIssue(file, line, reason) for line, reason in reader.problems])
    return LoadedTopology(file, topology, types.MappingProxyType(dict(reader.lines)))
