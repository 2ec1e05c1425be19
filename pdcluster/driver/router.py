"""Router policies: pure functions over plain load snapshots that pick a (prefill, decode) pair up front."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import NamedTuple

from pdcluster.engine.block_manager import compute_block_hashes


class PrefillLoad(NamedTuple):
    """One prefill rank. instance: the prefill instance's index in its pool."""

    instance: int
    num_queued_prefill_tokens: int
    cached_block_hashes: frozenset[bytes] = frozenset()
    rank: int = 0


class DecodeLoad(NamedTuple):
    """One decode rank. instance: the decode instance's index."""

    instance: int
    num_free_blocks: int
    num_running: int
    rank: int = 0


class RankRef(NamedTuple):
    """One rank of one instance: `instance` its pool index, `rank` its rank in the instance (0: leader)."""

    instance: int
    rank: int = 0


class RouteChoice(NamedTuple):
    """Where one request goes: the prefill (instance, rank) and the decode (instance, rank)."""

    prefill: RankRef
    decode: RankRef


def _choice(prefill: Sequence[PrefillLoad], p: int, decode: Sequence[DecodeLoad], d: int) -> RouteChoice:
    return RouteChoice(
        RankRef(prefill[p].instance, prefill[p].rank), RankRef(decode[d].instance, decode[d].rank)
    )


def _least_loaded_decode(decode: Sequence[DecodeLoad]) -> int:
    """Most free blocks, then the smaller batch, then the lower (instance, rank)."""

    def key(i: int) -> tuple[int, int, int, int]:
        return (-decode[i].num_free_blocks, decode[i].num_running, decode[i].instance, decode[i].rank)

    return min(range(len(decode)), key=key)


def round_robin(
    prefill: Sequence[PrefillLoad], decode: Sequence[DecodeLoad], counter: int, **_: object
) -> RouteChoice:
    """The `counter`-th request goes to prefill rank `counter % P` and decode rank `counter % D` (P, D: the
    ranks listed)."""
    _check(prefill, decode)
    return _choice(prefill, counter % len(prefill), decode, counter % len(decode))


def least_loaded(prefill: Sequence[PrefillLoad], decode: Sequence[DecodeLoad], **_: object) -> RouteChoice:
    """Prefill rank with the fewest queued prompt tokens; decode rank with the most free KV blocks, then the
    smallest running batch. Ties go to the lower (instance, rank)."""
    _check(prefill, decode)
    p = min(
        range(len(prefill)),
        key=lambda i: (prefill[i].num_queued_prefill_tokens, prefill[i].instance, prefill[i].rank),
    )
    return _choice(prefill, p, decode, _least_loaded_decode(decode))


def prefix_hit_tokens(prompt_token_ids: Sequence[int], block_size: int, cached: frozenset[bytes]) -> int:
    """Leading prompt tokens in full blocks whose chained hashes are all in `cached` (the engine's lookup
    rule: the last prompt token is always recomputed)."""
    num_hit = 0
    for block_hash in compute_block_hashes(list(prompt_token_ids[:-1]), block_size):
        if block_hash not in cached:
            break
        num_hit += block_size
    return num_hit


def prefix_aware(
    prefill: Sequence[PrefillLoad],
    decode: Sequence[DecodeLoad],
    prompt_token_ids: Sequence[int] = (),
    block_size: int = 16,
    **_: object,
) -> RouteChoice:
    """Prefill rank that has the fewest tokens left to compute: queued tokens plus this prompt's uncached
    tokens (prefix hits estimated from `cached_block_hashes`); decode as `least_loaded`."""
    _check(prefill, decode)

    def cost(i: int) -> tuple[int, int, int]:
        hit = prefix_hit_tokens(prompt_token_ids, block_size, prefill[i].cached_block_hashes)
        remaining = prefill[i].num_queued_prefill_tokens + len(prompt_token_ids) - hit
        return (remaining, prefill[i].instance, prefill[i].rank)

    return _choice(prefill, min(range(len(prefill)), key=cost), decode, _least_loaded_decode(decode))


POLICIES: dict[str, Callable[..., RouteChoice]] = {
    "round_robin": round_robin,
    "least_loaded": least_loaded,
    "prefix_aware": prefix_aware,
}


ROUTER_CACHE_BLOCKS = 4096  # block hashes remembered per prefill rank for prefix-aware routing


class PrefixCacheModel:
    """An estimate of each prefill rank's cache: the block hashes of the prompts sent there, LRU, at most
    `capacity_blocks` per rank."""

    def __init__(self, block_size: int, capacity_blocks: int = ROUTER_CACHE_BLOCKS) -> None:
        self.block_size = block_size
        self.capacity_blocks = capacity_blocks
        self._hashes: dict[RankRef, OrderedDict[bytes, None]] = {}

    def record(self, rank: RankRef, prompt_token_ids: Sequence[int]) -> None:
        """The prompt's full blocks were sent to prefill `rank` (most recent now)."""
        remembered = self._hashes.setdefault(rank, OrderedDict())
        for block_hash in compute_block_hashes(list(prompt_token_ids), self.block_size):
            remembered[block_hash] = None
            remembered.move_to_end(block_hash)
        while len(remembered) > self.capacity_blocks:
            remembered.popitem(last=False)

    def cached(self, rank: RankRef) -> frozenset[bytes]:
        """The block hashes prefill `rank` is believed to cache (`PrefillLoad.cached_block_hashes`)."""
        return frozenset(self._hashes.get(rank, ()))


def _check(prefill: Sequence[PrefillLoad], decode: Sequence[DecodeLoad]) -> None:
    if not prefill:
        raise ValueError("no live prefill instance to route to")
    if not decode:
        raise ValueError("no live decode instance to route to")
