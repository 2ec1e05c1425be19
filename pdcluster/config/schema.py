"""The topology schema: one frozen dataclass per YAML section, each checking its fields on construction."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from pdcluster.config.autoscale import AutoscaleConfig
from pdcluster.config.engine_args import engine_arguments
from pdcluster.config.fields import (
    MAX_BLOCK_SIZE,
    MAX_CPUS_PER_DEVICE,
    MAX_DEVICES,
    MAX_DEVICES_PER_NODE,
    MAX_INSTANCES,
    MAX_KV_CACHE_BYTES,
    MAX_NODES,
    MAX_SEQS,
    MAX_SPECULATIVE_TOKENS,
    MAX_TIMEOUT_S,
    MAX_TOKENS,
    MIB,
    above,
    above_at_most,
    api_key_problem,
    at_least,
    between,
    check_fields,
    choices,
    host_problem,
)
from pdcluster.config.hardware import ACCELERATORS, AcceleratorSpec
from pdcluster.config.quality import AccuracyConfig, KVPrecisionConfig
from pdcluster.driver.router import POLICIES
from pdcluster.engine.config import KV_CACHE_DTYPES, EngineConfig
from pdcluster.models import bundled_checkpoint_dir
from pdcluster.models.dtypes import MODEL_DTYPE_NAMES

DEFAULT_TOPOLOGY_PATH = Path(__file__).resolve().parents[2] / "clusters" / "local.yaml"

ROLES = ("prefill", "decode")
MODEL_DTYPES = ("auto", *MODEL_DTYPE_NAMES)
# model.weight_dtype: a model dtype, or an 8-bit one (the names `planner.op_costs.DTYPE_BYTES` gives 1 byte)
EIGHT_BIT_WEIGHT_DTYPES = ("int8", "fp8")
WEIGHT_DTYPES = (*MODEL_DTYPES, *EIGHT_BIT_WEIGHT_DTYPES)
KV_TRANSPORTS = ("auto", "grpc", "shm", "torch_distributed")
# decode listens at an address each prefill sender connects to (shm+grpc: `auto` on several nodes)
ADDRESSED_KV_TRANSPORTS = ("grpc", "shm", "shm+grpc")
WIRE_DTYPES = ("auto", "int8")
ROUTER_POLICIES = tuple(POLICIES)

DEFAULT_MAX_REQUEST_BODY_BYTES = 4 * MIB
CONCURRENT_REQUESTS_PER_DECODE_SEAT = 2


@dataclass(frozen=True)
class LinkConfig:
    """One level of the interconnect, per device and per direction."""

    bandwidth_bytes_per_s: float = field(metadata=above(0))
    latency_s: float = field(metadata=at_least(0))

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True)
class InterconnectConfig:
    """Links between devices, from the closest level to the farthest."""

    die_to_die: LinkConfig | None = None
    intra_node: LinkConfig = field(default_factory=lambda: LinkConfig(10e9, 5e-6))
    supernode: LinkConfig | None = None
    inter_node: LinkConfig = field(default_factory=lambda: LinkConfig(12.5e9, 10e-6))

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True)
class HardwareConfig:
    """The machines."""

    accelerator: str = field(default="cpu", metadata=choices(*ACCELERATORS))
    num_nodes: int = field(default=1, metadata=between(1, MAX_NODES))
    devices_per_node: int = field(default=2, metadata=between(1, MAX_DEVICES_PER_NODE))
    nodes_per_supernode: int | None = field(default=None, metadata=between(1, MAX_NODES))
    cpus_per_device: float = field(default=1.0, metadata=above_at_most(0, MAX_CPUS_PER_DEVICE))

    def __post_init__(self) -> None:
        check_fields(self)

    @property
    def spec(self) -> AcceleratorSpec:
        return ACCELERATORS[self.accelerator]

    @property
    def num_devices(self) -> int:
        return self.num_nodes * self.devices_per_node


@dataclass(frozen=True)
class ModelConfig:
    """The checkpoint every instance serves. dtype: `auto` is float32 on cpu, bfloat16 on accelerators;
    weight_dtype: `auto` is `dtype` resolved, `int8` / `fp8` are 8-bit weights."""

    path: str | None = None
    config_path: str | None = None
    dtype: str = field(default="auto", metadata=choices(*MODEL_DTYPES))
    weight_dtype: str = field(default="auto", metadata=choices(*WEIGHT_DTYPES))

    def __post_init__(self) -> None:
        check_fields(self)

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

    def resolved_weight_dtype(self, spec: AcceleratorSpec) -> str:
        """`weight_dtype`, with `auto` the resolved `dtype`."""
        return self.resolved_dtype(spec) if self.weight_dtype == "auto" else self.weight_dtype


class InstanceSplit:
    """An instance's devices over TP (attention DP = devices / TP) and EP (MoE TP = devices / EP)."""

    devices_per_instance: int
    tensor_parallel_size: int
    expert_parallel_size: int

    @property
    def attention_data_parallel_size(self) -> int:
        return self.devices_per_instance // self.tensor_parallel_size

    @property
    def moe_tensor_parallel_size(self) -> int:
        return self.devices_per_instance // self.expert_parallel_size


@dataclass(frozen=True)
class PoolConfig(InstanceSplit):
    """What the prefill and decode pools share. kv_cache_dtype: `auto` (model dtype) or `int8` (per-token
    scales); compile: ignored (eager, with a warning) with an int8 KV cache or expert parallelism.
    elastic_stall_s: seconds a rank of a multi-rank instance may leave probes unanswered while its peers
    wait that long in one collective before elastic EP counts it lost (> 0; a slow rank is not lost)."""

    num_instances: int = field(default=1, metadata=between(1, MAX_INSTANCES))
    devices_per_instance: int = field(default=1, metadata=between(1, MAX_DEVICES))
    span_nodes: bool = False
    tensor_parallel_size: int = field(default=1, metadata=between(1, MAX_DEVICES))
    expert_parallel_size: int = field(default=1, metadata=between(1, MAX_DEVICES))
    num_redundant_experts: int = field(default=0, metadata=between(0, MAX_INSTANCES))
    eplb_interval_steps: int | None = field(default=None, metadata=between(1, MAX_TOKENS))
    block_size: int = field(default=16, metadata=between(1, MAX_BLOCK_SIZE))
    kv_cache_dtype: str = field(default="auto", metadata=choices(*KV_CACHE_DTYPES))
    kv_cache_memory_bytes: int = field(default=256 * MIB, metadata=between(1, MAX_KV_CACHE_BYTES))
    max_num_batched_tokens: int = field(default=2048, metadata=between(1, MAX_TOKENS))
    max_num_seqs: int = field(default=64, metadata=between(1, MAX_SEQS))
    max_model_len: int | None = field(default=None, metadata=between(1, MAX_TOKENS))
    enable_prefix_caching: bool = True
    compile: bool = False
    engine_watchdog_s: float = field(default=300.0, metadata=between(1, MAX_TIMEOUT_S))
    # A multi-rank instance that loses ranks shrinks onto its survivors (`driver.elastic`); false: it leaves.
    elastic_ep: bool = True
    elastic_stall_s: float = field(default=5.0, metadata=above_at_most(0, MAX_TIMEOUT_S))

    def __post_init__(self) -> None:
        check_fields(self)

    @property
    def num_devices(self) -> int:
        """Devices of the whole pool."""
        return self.num_instances * self.devices_per_instance


@dataclass(frozen=True)
class PrefillPoolConfig(PoolConfig):
    """The prefill pool."""

    enable_chunked_prefill: bool = True


@dataclass(frozen=True)
class DecodePoolConfig(PoolConfig):
    """The decode pool."""

    num_speculative_tokens: int = field(default=0, metadata=between(0, MAX_SPECULATIVE_TOKENS))
    adaptive_speculation: bool = False
    compile: bool | None = None


@dataclass(frozen=True)
class KVTLSConfig:
    """Mutual TLS on the gRPC KV channel: each side presents `cert_file`, accepts peers `ca_file` signed."""

    cert_file: str
    key_file: str
    ca_file: str
    server_name: str | None = None

    def __post_init__(self) -> None:
        check_fields(self)
        for name in ("cert_file", "key_file", "ca_file"):
            if not getattr(self, name):
                raise ValueError(f"KVTLSConfig field {name!r}: must not be empty")


TLS_FILE_KEYS = ("cert_file", "key_file", "ca_file")


@dataclass(frozen=True)
class KVTransferConfig:
    """Prefill -> decode KV handoff. wire_dtype: `auto` (what decode's KV cache stores; int8 passes through
    unchanged) or `int8` (quantized per token on the wire)."""

    transport: str = field(default="auto", metadata=choices(*KV_TRANSPORTS))
    layerwise: bool = True
    wire_dtype: str = field(default="auto", metadata=choices(*WIRE_DTYPES))
    timeout_s: float = field(default=30.0, metadata=above_at_most(0, MAX_TIMEOUT_S))
    tls: KVTLSConfig | None = None

    def __post_init__(self) -> None:
        check_fields(self)


def resolve_kv_transport(kv: KVTransferConfig, num_nodes: int) -> str:
    """`kv.transport`, with `auto` resolved: `grpc` with TLS, else `shm` on one node and `shm+grpc` (same-node
    pairs through shared memory, `kvtransfer.paired`) on several."""
    if kv.transport != "auto":
        return kv.transport
    if kv.tls is not None:
        return "grpc"
    return "shm" if num_nodes == 1 else "shm+grpc"


@dataclass(frozen=True)
class RouterConfig:
    """`policy`: a name of `driver.router.POLICIES` (round_robin, least_loaded, prefix_aware)."""

    policy: str = field(default="least_loaded", metadata=choices(*ROUTER_POLICIES))

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True)
class SLOConfig:
    """Latency targets (None: no target): time to first token and time per output token."""

    ttft_ms: float | None = field(default=None, metadata=above(0))
    tpot_ms: float | None = field(default=None, metadata=above(0))

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True)
class ApiConfig:
    """The OpenAI-compatible HTTP endpoint (`entrypoints.openai`)."""

    host: str = field(default="127.0.0.1", metadata={"check": host_problem})
    port: int = field(default=8000, metadata=between(0, 65535))
    api_key: str | None = field(default=None, metadata={"check": api_key_problem})
    max_request_body_bytes: int = field(
        default=DEFAULT_MAX_REQUEST_BODY_BYTES, metadata=between(1024, 1 << 30)
    )
    max_concurrent_requests: int | None = field(default=None, metadata=between(1, 1_000_000))

    def __post_init__(self) -> None:
        check_fields(self)


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
    kv_precision: KVPrecisionConfig | None = None
    accuracy: AccuracyConfig = field(default_factory=AccuracyConfig)
    autoscale: AutoscaleConfig = field(default_factory=AutoscaleConfig)

    def __post_init__(self) -> None:
        check_fields(self)
        if not self.name:
            raise ValueError("Topology field 'name': must not be empty")

    @property
    def max_concurrent_requests(self) -> int:
        """`api.max_concurrent_requests`, or if null `CONCURRENT_REQUESTS_PER_DECODE_SEAT` x decode seats."""
        if self.api.max_concurrent_requests is not None:
            return self.api.max_concurrent_requests
        return CONCURRENT_REQUESTS_PER_DECODE_SEAT * self.decode.num_instances * self.decode.max_num_seqs

    @property
    def kv_transport(self) -> str:
        """`kv_transfer.transport` with `auto` resolved (`resolve_kv_transport`)."""
        return resolve_kv_transport(self.kv_transfer, self.hardware.num_nodes)

    def pool(self, role: str) -> PoolConfig:
        """The `prefill` or `decode` pool."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        return self.prefill if role == "prefill" else self.decode

    def compiles(self, role: str) -> bool:
        """Whether pool `role`'s engines compile their decode forward: its `compile`, or if null `cpu` or not.
        Raises ValueError: `role` is neither `prefill` nor `decode`."""
        compile_ = self.pool(role).compile
        return compile_ if compile_ is not None else self.hardware.spec.torch_device_type == "cpu"

    def engine_config(self, role: str, rank: int = 0) -> EngineConfig:
        """The engine arguments of rank `rank` of pool `role` (`engine_args.engine_arguments`).
        Raises ValueError: `role` is neither `prefill` nor `decode`, or the engine refuses an argument."""
        return EngineConfig(**engine_arguments(self, role, rank))

    def summary(self) -> str:
        """One line: `1 node × 2 cpu, prefill 1×1 devices, decode 1×1 devices, KV shm (auto)`."""
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
        kv = self.kv_transport + (" (auto)" if self.kv_transfer.transport == "auto" else "")
        return f"{nodes} × {per_node}, {pools}, KV {kv}"
