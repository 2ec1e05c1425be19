"""Cluster topology: the YAML schema as frozen dataclasses, and its pre-flight validation.

One YAML file (see `clusters/README.md` for every key) describes the hardware, the links between devices,
the model, the prefill and decode pools, KV transfer, routing, SLOs and the HTTP API. YAML keys equal
field names. `load_topology(path)` reads it with line numbers and checks it before anything starts;
every problem found is reported at once, one `FILE:LINE: reason` per line, in a `TopologyError`.

Validation happens in two layers: each dataclass checks its own fields (type, choice, range) on
construction, so one built in code is checked too; `check_topology` checks what needs several sections
and the model's `config.json` (divisibility, MTP, weights + KV cache per device, device counts, placement).

    fields.py       field metadata (choices, bounds, checks) and the check of one field's value
    schema.py       the dataclasses, one per YAML section, and `Topology` (pools, engine arguments, summary)
    rules.py        cross-section rules: `check_topology`, `cross_section_issues`
    issues.py       `Issue` (at a key path), `TopologyIssue` (at a file's line), `TopologyError`
    yaml_file.py    the file as YAML nodes within size, depth and alias-expansion bounds
    yaml_loader.py  nodes into dataclasses with each key's line: `read_topology`, `load_topology`
"""

from pdcluster.orchestrator.topology.fields import MIB, api_key_problem, host_problem
from pdcluster.orchestrator.topology.issues import Issue, KeyPath, TopologyError, TopologyIssue
from pdcluster.orchestrator.topology.rules import check_topology, read_model_architecture
from pdcluster.orchestrator.topology.schema import (
    ADDRESSED_KV_TRANSPORTS,
    CONCURRENT_REQUESTS_PER_DECODE_SEAT,
    DEFAULT_MAX_REQUEST_BODY_BYTES,
    DEFAULT_TOPOLOGY_PATH,
    EIGHT_BIT_WEIGHT_DTYPES,
    KV_TRANSPORTS,
    MODEL_DTYPES,
    ROLES,
    ROUTER_POLICIES,
    TLS_FILE_KEYS,
    WEIGHT_DTYPES,
    WIRE_DTYPES,
    ApiConfig,
    DecodePoolConfig,
    HardwareConfig,
    InterconnectConfig,
    KVTLSConfig,
    KVTransferConfig,
    LinkConfig,
    ModelConfig,
    PoolConfig,
    PrefillPoolConfig,
    RouterConfig,
    SLOConfig,
    Topology,
    resolve_kv_transport,
)
from pdcluster.orchestrator.topology.yaml_file import MAX_YAML_BYTES, MAX_YAML_DEPTH, MAX_YAML_NODES
from pdcluster.orchestrator.topology.yaml_loader import LoadedTopology, load_topology, read_topology

__all__ = [
    "ADDRESSED_KV_TRANSPORTS",
    "CONCURRENT_REQUESTS_PER_DECODE_SEAT",
    "DEFAULT_MAX_REQUEST_BODY_BYTES",
    "DEFAULT_TOPOLOGY_PATH",
    "EIGHT_BIT_WEIGHT_DTYPES",
    "KV_TRANSPORTS",
    "MAX_YAML_BYTES",
    "MAX_YAML_DEPTH",
    "MAX_YAML_NODES",
    "MIB",
    "MODEL_DTYPES",
    "ROLES",
    "ROUTER_POLICIES",
    "TLS_FILE_KEYS",
    "WEIGHT_DTYPES",
    "WIRE_DTYPES",
    "ApiConfig",
    "DecodePoolConfig",
    "HardwareConfig",
    "InterconnectConfig",
    "Issue",
    "KVTLSConfig",
    "KVTransferConfig",
    "KeyPath",
    "LinkConfig",
    "LoadedTopology",
    "ModelConfig",
    "PoolConfig",
    "PrefillPoolConfig",
    "RouterConfig",
    "SLOConfig",
    "Topology",
    "TopologyError",
    "TopologyIssue",
    "api_key_problem",
    "check_topology",
    "host_problem",
    "load_topology",
    "read_model_architecture",
    "read_topology",
    "resolve_kv_transport",
]
