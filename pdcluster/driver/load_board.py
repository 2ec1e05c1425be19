"""`LoadBoard`: the router's view of every rank's load, kept without a Ray call per request."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence

from pdcluster.driver.messages import DecodeNodeLoad
from pdcluster.driver.router import DecodeLoad, RankRef


class LoadBoard:
    """Latest decode snapshots and in-flight work per rank (see the module docstring). `num_ranks`:
    per decode instance, in pool order, its number of ranks."""

    def __init__(self, num_decode_ranks: Sequence[int]) -> None:
        if any(n < 1 for n in num_decode_ranks):
            raise ValueError(f"every decode instance has at least one rank, got {list(num_decode_ranks)}")
        self._lock = threading.Lock()
        self._num_decode_ranks = tuple(num_decode_ranks)
        self._decode: dict[RankRef, DecodeNodeLoad] = {}
        self._reserving: dict[RankRef, int] = {}  # reserve calls sent, reply not yet seen
        self._prefill_tokens: dict[RankRef, int] = {}  # prompt tokens of prefill calls in flight
        self._prefill_calls: dict[RankRef, int] = {}  # prefill calls in flight
        self._decode_epoch: dict[int, int] = {}  # decode instance -> times its ranks were re-counted

    # ---- decode ---------------------------------------------------------------------------------------
    def update_decode(self, rank: RankRef, load: DecodeNodeLoad) -> None:
        """Record `load` for decode `rank` unless the board holds a later snapshot of the same process."""
        self._check_decode(rank)
        with self._lock:
            held = self._decode.get(rank)
            if held is None or held.pid != load.pid or load.taken_s >= held.taken_s:
                self._decode[rank] = load

    def set_decode_ranks(self, instance: int, num_ranks: int) -> None:
        """Decode `instance` has `num_ranks` ranks now (elastic EP): its snapshots are dropped."""
        with self._lock:
            counts = list(self._num_decode_ranks)
            counts[instance] = num_ranks
            self._num_decode_ranks = tuple(counts)
            self._decode_epoch[instance] = self._decode_epoch.get(instance, 0) + 1
            for table in (self._decode, self._reserving):
                for rank in [r for r in table if r.instance == instance]:
                    del table[rank]

    def add_decode(self, num_ranks: int) -> int:
        """A decode instance of `num_ranks` ranks joins the pool's end (dynamic P:D); returns its index."""
        with self._lock:
            self._num_decode_ranks += (num_ranks,)
            return len(self._num_decode_ranks) - 1

    def forget_decode(self, instance: int) -> None:
        """Drop every snapshot of decode `instance` (it left routing: what it reported is stale)."""
        with self._lock:
            for rank in [r for r in self._decode if r.instance == instance]:
                del self._decode[rank]

    def missing_decodes(self, instances: Iterable[int]) -> list[int]:
        """Of decode `instances`, those with a rank no snapshot has reached: they need one `load` call."""
        with self._lock:
            return [
                i
                for i in instances
                if any(RankRef(i, r) not in self._decode for r in range(self._num_decode_ranks[i]))
            ]

    def decode_snapshots(self, instance: int) -> list[DecodeNodeLoad]:
        """The latest snapshot of each rank of decode `instance`, rank order.

        Raises KeyError: a rank has none yet (`missing_decodes` says which instances).
        """
        with self._lock:
            return [self._decode[RankRef(instance, r)] for r in range(self._num_decode_ranks[instance])]

    def decode_loads(self, instance: int) -> list[DecodeLoad]:
        """The router's loads of decode `instance`, one per rank: free KV blocks of the latest snapshot and
        its batch (running + reserved + waiting for a seat) plus the reserves in flight to the rank."""
        with self._lock:
            loads = []
            for r in range(self._num_decode_ranks[instance]):
                ref = RankRef(instance, r)
                snapshot = self._decode[ref]
                batch = snapshot.batch_load + self._reserving.get(ref, 0)
                loads.append(DecodeLoad(instance, snapshot.num_free_blocks, batch, r))
            return loads

    def reserve_sent(self, rank: RankRef) -> int:
        """A reserve call to decode `rank` is on its way (counted in the rank's batch until its reply);
        returns the instance's epoch, to give back to `reserve_answered`."""
        self._check_decode(rank)
        with self._lock:
            self._reserving[rank] = self._reserving.get(rank, 0) + 1
            return self._decode_epoch.get(rank.instance, 0)

    def reserve_answered(self, rank: RankRef, load: DecodeNodeLoad | None, epoch: int = 0) -> None:
        """The reserve call to `rank` ended; `load`: the snapshot its reply carried (None: it failed).
        A call sent before the instance's ranks were re-counted (`set_decode_ranks`; `epoch` older) is
        forgotten already: neither its count nor its snapshot is kept.
        Raises ValueError: more answers than calls sent in this epoch."""
        with self._lock:
            if epoch != self._decode_epoch.get(rank.instance, 0):
                return
            left = self._reserving.get(rank, 0) - 1
            if left < 0:
                raise ValueError(f"decode rank {tuple(rank)}: a reserve answered that was never sent")
            if left:
                self._reserving[rank] = left
            else:
                self._reserving.pop(rank, None)
        if load is not None:
            self.update_decode(rank, load)

    # ---- prefill --------------------------------------------------------------------------------------
    def prefill_started(self, rank: RankRef, num_tokens: int) -> None:
        """`num_tokens` prompt tokens were routed to prefill `rank` (counted until `prefill_ended`)."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        with self._lock:
            self._prefill_tokens[rank] = self._prefill_tokens.get(rank, 0) + num_tokens
            self._prefill_calls[rank] = self._prefill_calls.get(rank, 0) + 1

    def prefill_ended(self, rank: RankRef, num_tokens: int) -> None:
        """The work `prefill_started(rank, num_tokens)` counted is over (prefilled, failed or dropped)."""
        with self._lock:
            left = self._prefill_tokens.get(rank, 0) - num_tokens
            calls = self._prefill_calls.get(rank, 0) - 1
            if left < 0 or calls < 0:
                raise ValueError(f"prefill rank {tuple(rank)}: {num_tokens} tokens ended, fewer in flight")
            for counts, value in ((self._prefill_tokens, left), (self._prefill_calls, calls)):
                if value:
                    counts[rank] = value
                else:
                    counts.pop(rank, None)

    def prefill_queued_tokens(self, rank: RankRef) -> int:
        """Prompt tokens of the driver's prefill work in flight on `rank`."""
        with self._lock:
            return self._prefill_tokens.get(rank, 0)

    def prefill_calls(self, rank: RankRef) -> int:
        """The driver's prefill calls in flight on `rank` (each holds one of the actor's call threads)."""
        with self._lock:
            return self._prefill_calls.get(rank, 0)

    def _check_decode(self, rank: RankRef) -> None:
        if not (0 <= rank.instance < len(self._num_decode_ranks)) or not (
            0 <= rank.rank < self._num_decode_ranks[rank.instance]
        ):
            raise ValueError(f"no decode rank {tuple(rank)} (ranks per instance: {self._num_decode_ranks})")
