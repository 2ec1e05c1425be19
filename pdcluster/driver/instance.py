"""`Instance`: one prefill or decode instance as the driver sees it, a group of rank actors."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pdcluster.driver.health import InstanceHealth
from pdcluster.driver.messages import DecodeNodeLoad, PrefillNodeLoad
from pdcluster.driver.rank_client import RankClient, RayRankClient
from pdcluster.driver.request_state import rank_name
from pdcluster.driver.router import DecodeLoad, PrefillLoad, RankRef


@dataclass
class Instance:
    """One instance: `role` ("prefill" | "decode"), `index` in its pool, `ranks` (Ray actor handles, rank
    order; rank 0 leads), and its health.
    """

    role: str
    index: int
    ranks: list[Any]
    health: InstanceHealth = field(default_factory=InstanceHealth)
    deployed_ranks: int = 0  # ranks at deploy (0: as many as `ranks`)
    lost_ranks: int = 0  # ranks lost and shrunk away since deploy (`driver.elastic`)
    recoveries: int = 0  # times it was re-formed on fewer ranks
    rejoins: int = 0  # times new ranks joined it after that
    may_recover: bool = False  # out of routing, it may shrink onto its surviving ranks (`driver.elastic`)
    bundles: list[int] = field(default_factory=list)  # placement-group bundle of each rank ([]: rank r, r)
    # dynamic P:D (`driver.role_moves`): "active"; "draining" (serves its work, takes none); "away" (its
    # actor serves the other pool, or is switching: this slot is out of routing and unprobed)
    pool_state: str = "active"
    home: str = ""  # the name it was deployed with (its actor's across moves; "": `name`)
    transport: str = "ray"  # how the driver calls its ranks (`driver.wiring.rank_transport`): ray | socket
    _clients: dict[int, RankClient] = field(default_factory=dict, repr=False)

    def client(self, rank: int) -> RankClient:
        """The driver's `RankClient` of rank `rank` (a new one when its actor was replaced)."""
        actor = self.ranks[rank]
        client = self._clients.get(rank)
        if client is None or client.actor is not actor:
            if client is not None:
                client.close()
            if self.transport == "socket":
                from pdcluster.driver.socket_rank_client import SocketRankClient

                client = SocketRankClient(actor, self.role, self.rank_name(rank))
            else:
                client = RayRankClient(actor, ordered=self.role == "prefill")
            self._clients[rank] = client
        return client

    @property
    def clients(self) -> list[RankClient]:
        return [self.client(rank) for rank in range(self.num_ranks)]

    @property
    def name(self) -> str:
        return f"{self.role}-{self.index}"

    @property
    def leader(self) -> Any:
        """Rank 0's actor (it hosts the instance group's rendezvous)."""
        return self.ranks[0]

    @property
    def num_ranks(self) -> int:
        return len(self.ranks)

    def rank_name(self, rank: int) -> str:
        """One rank's name in logs, loads and leak reports: `decode-0` for rank 0, `decode-0.1` for rank 1."""
        return rank_name(self.role, RankRef(self.index, rank))

    @property
    def routable(self) -> bool:
        """Healthy and in its pool (active or draining): its work in flight is served."""
        return self.health.routable and self.pool_state != "away"

    @property
    def accepting(self) -> bool:
        """Routable and not draining: new requests may be routed to it."""
        return self.health.routable and self.pool_state == "active"

    @property
    def num_deployed_ranks(self) -> int:
        """Ranks at deploy (an elastic shrink leaves fewer live)."""
        return self.deployed_ranks or self.num_ranks

    @property
    def degraded(self) -> bool:
        """Serving on fewer ranks than it was deployed with."""
        return self.num_ranks < self.num_deployed_ranks


def check_instance_group(ranks: Sequence[PrefillNodeLoad | DecodeNodeLoad]) -> None:
    """Raise `InstanceGroupFailed` naming the first rank whose load reports a failed instance group."""
    from pdcluster.driver.actor_errors import InstanceGroupFailed

    for r in ranks:
        if r.instance_group_error is not None:
            raise InstanceGroupFailed(f"{r.name}: instance group failed: {r.instance_group_error}")


def prefill_rank_loads(
    instance: int, ranks: Sequence[PrefillNodeLoad], cached: Callable[[RankRef], frozenset[bytes]]
) -> list[PrefillLoad]:
    """The router's loads of a prefill instance, one per rank (attention is data-parallel: each rank
    prefills its own prompts): its queued prompt tokens and the block hashes `cached(RankRef)` says the
    router sent that rank."""
    return [
        PrefillLoad(instance, r.num_queued_prefill_tokens, cached(RankRef(instance, rank)), rank)
        for rank, r in enumerate(ranks)
    ]


def decode_rank_loads(instance: int, ranks: Sequence[DecodeNodeLoad]) -> list[DecodeLoad]:
    """The router's loads of a decode instance, one per rank (each rank owns its requests and its paged KV
    cache): its free KV blocks and its batch (running, reserved, waiting for a seat)."""
    return [DecodeLoad(instance, r.num_free_blocks, r.batch_load, rank) for rank, r in enumerate(ranks)]
