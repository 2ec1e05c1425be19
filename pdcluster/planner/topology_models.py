"""A `PerfModel` per pool of a topology YAML: dtypes, parallelism and link levels read from the file."""

from __future__ import annotations

import math
from pathlib import Path

from pdcluster.config import Topology
from pdcluster.config.rules import read_model_architecture
from pdcluster.models.config import DeepseekV3Config
from pdcluster.planner import op_costs as oc
from pdcluster.planner.efficiency import get_efficiency
from pdcluster.planner.op_costs import Dtypes
from pdcluster.planner.perf_model import Link, Parallelism, PerfModel


def link_level(topology: Topology, num_devices: int, *, across_instances: bool = False) -> Link:
    """The link level a group of `num_devices` spans, or with `across_instances` P -> D."""
    hw, ic = topology.hardware, topology.interconnect
    dies = hw.spec.dies_per_chip
    if across_instances:
        if hw.num_nodes == 1:
            name = "intra_node"
        else:
            name = "supernode" if ic.supernode is not None else "inter_node"
    elif num_devices <= 1:
        name = "intra_node"
    elif dies > 1 and num_devices <= dies and ic.die_to_die is not None:
        name = "die_to_die"
    elif num_devices <= hw.devices_per_node:
        name = "intra_node"
    elif ic.supernode is not None and hw.nodes_per_supernode is not None:
        fits = math.ceil(num_devices / hw.devices_per_node) <= hw.nodes_per_supernode
        name = "supernode" if fits else "inter_node"
    else:
        name = "inter_node"
    link = getattr(ic, name)
    return Link(link.bandwidth_bytes_per_s, link.latency_s, name)


def perf_model_for(
    topology: Topology,
    role: str,
    *,
    calibration: str | Path | None = None,
    config: DeepseekV3Config | None = None,
    weight_dtype: str | None = None,
    node_forwarding: bool = False,
    **kwargs,
) -> PerfModel:
    """The `PerfModel` of one instance of pool `role` of `topology`, dtypes, links and efficiency (catalog or
    `calibration`) from the file; `kwargs` go to `PerfModel`. Raises ValueError for a bad `role`, an
    unreadable model config.json or calibration, or a dtype without a peak."""
    from pdcluster.planner.calibration import load_calibration

    pool = topology.pool(role)
    spec = topology.hardware.spec
    cfg = config or read_model_architecture(topology.model)
    model_dtype = topology.model.resolved_dtype(spec)
    weight = weight_dtype or topology.model.resolved_weight_dtype(spec)
    activation = model_dtype if weight in oc.DTYPE_BYTES and weight not in ("int8", "fp8") else "bfloat16"
    kv = activation if pool.kv_cache_dtype == "auto" else pool.kv_cache_dtype
    decode_kv = activation if topology.decode.kv_cache_dtype == "auto" else topology.decode.kv_cache_dtype
    wire = decode_kv if topology.kv_transfer.wire_dtype == "auto" else topology.kv_transfer.wire_dtype
    efficiency = get_efficiency(spec.name)
    if calibration is not None:
        efficiency = load_calibration(
            calibration, efficiency, accelerator=spec.name, kv_transport=topology.kv_transport
        )
        kwargs.setdefault("kernel_tables", None)  # a calibration replaces the published tables
    parallel = Parallelism(
        pool.devices_per_instance,
        pool.tensor_parallel_size,
        pool.expert_parallel_size,
        pool.num_redundant_experts,
    )
    kwargs.setdefault("mtp_in_prefill", role == "prefill" and topology.decode.num_speculative_tokens > 0)
    return PerfModel(
        cfg,
        spec,
        efficiency,
        dtypes=Dtypes(weight, activation, kv),
        parallel=parallel,
        ep_link=link_level(topology, pool.expert_parallel_size),
        tp_link=link_level(topology, pool.tensor_parallel_size),
        kv_link=link_level(topology, 0, across_instances=True),
        kv_wire_dtype=wire,
        layerwise_kv=topology.kv_transfer.layerwise,
        node_forwarding=(topology.hardware.devices_per_node, link_level(topology, 2))
        if node_forwarding
        else None,
        **kwargs,
    )
