"""`Instance`: one prefill or decode instance as the driver sees it, a group of rank actors.

An instance is routed to as one unit, reports one load (`prefill_instance_load` / `decode_instance_load`
over its ranks' loads, which stay readable per rank), and fails as one unit: its health
(`orchestrator.health.InstanceHealth`) is the instance's, and a rank that dies or stops answering takes
the whole instance out of routing. Requests address (instance, rank) (`orchestrator.router.RankRef`); the
leader, rank 0, takes the request path's calls. Every instance has one rank today (`deploy` refuses
instances of more than one device); the expert-parallel work adds ranks here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from orchestrator.health import InstanceHealth
from orchestrator.messages import DecodeNodeLoad, PrefillNodeLoad
from orchestrator.router import DecodeLoad, PrefillLoad


@dataclass
class Instance:
    """One instance: `role` ("prefill" | "decode"), `index` in its pool, `ranks` (Ray actor handles, rank
    order; rank 0 leads), and its health. The health is replaced (not mutated) by the driver under its
    health lock."""

    role: str
    index: int
    ranks: list[Any]
    health: InstanceHealth = field(default_factory=InstanceHealth)

    @property
    def name(self) -> str:
        return f"{self.role}-{self.index}"

    @property
    def leader(self) -> Any:
        """Rank 0's actor: the one the request path calls."""
        return self.ranks[0]

    @property
    def routable(self) -> bool:
        return self.health.routable


def prefill_instance_load(
    instance: int, ranks: Sequence[PrefillNodeLoad], cached_block_hashes: frozenset[bytes] = frozenset()
) -> PrefillLoad:
    """The router's load of a prefill instance from its ranks' loads: the most queued prompt tokens of any
    rank (every rank works on the instance's whole batch, so the busiest bounds it)."""
    return PrefillLoad(instance, max(r.num_queued_prefill_tokens for r in ranks), cached_block_hashes)


def decode_instance_load(instance: int, ranks: Sequence[DecodeNodeLoad]) -> DecodeLoad:
    """The router's load of a decode instance from its ranks' loads: the fewest free KV blocks of any rank
    (a request needs room on each) and the largest batch (running, reserved, waiting for a seat)."""
    return DecodeLoad(instance, min(r.num_free_blocks for r in ranks), max(r.batch_load for r in ranks))
