"""Expert slots one rank may hold after its instance shrank (elastic EP): what its device's memory budget
leaves for routed experts once its other weights and its KV cache are counted (`planner.memory`); and
whether a shrink was refused for want of them."""

from __future__ import annotations

from typing import Any


def survivor_expert_slots(topology: Any, role: str) -> int:
    """Routed expert slots per MoE layer one rank of pool `role` may hold: the most that, with its other
    parameters (`pool_resident_params`) and `kv_cache_memory_bytes`, fit one device's `hbm_bytes`; at least
    its deployed slots, at most every logical expert (0 without routed experts).
    Raises ValueError: the model's config.json is unreadable, or its weight dtype unknown."""
    from pdcluster.config.rules import read_model_architecture
    from pdcluster.planner.memory import pool_resident_params
    from pdcluster.planner.op_costs import dtype_bytes

    pool, spec = topology.pool(role), topology.hardware.spec
    arch = read_model_architecture(topology.model)
    params = pool_resident_params(arch, pool)
    deployed = params.experts_per_layer
    if deployed == 0:
        return 0
    width = dtype_bytes(topology.model.resolved_weight_dtype(spec), "weight dtype")
    slot_bytes = params.routed_experts // deployed * width  # one slot in every MoE layer
    free_bytes = spec.hbm_bytes - pool.kv_cache_memory_bytes - params.replicated * width
    return max(deployed, min(arch.n_routed_experts, free_bytes // slot_bytes))


def placement_refused(error: BaseException) -> bool:
    """`error` is a `PlacementRefused`, raised here or in a rank actor (Ray's `RayTaskError.cause`)."""
    from pdcluster.models.elastic_placement import PlacementRefused

    return isinstance(error, PlacementRefused) or isinstance(getattr(error, "cause", None), PlacementRefused)
