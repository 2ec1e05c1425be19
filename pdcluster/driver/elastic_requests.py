"""Requests of an elastic EP instance that lost ranks (`driver.elastic`). Decode: those whose KV decode holds
on a surviving rank wait for the re-formed group and go on there, renumbered; the others are re-dispatched.
Prefill: a surviving rank's step failed with its group (its KV was streaming layer-wise, so it is not rolled
back), so every in-flight prefill is re-dispatched, the re-formed instance not excluded (`reforming`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from typing import Any

from pdcluster.driver.handoff import decode_has_it
from pdcluster.driver.router import RankRef

GROUP_FAILED = "instance group failed"  # in a prefill rank's error for the requests its failed group ended


def reforming(prefill: Any, elastic: bool, message: str = GROUP_FAILED) -> bool:
    """A prefill call on instance `prefill` (of an `elastic` pool) that failed with `message` (by default:
    a rank or the instance was lost) failed with a group that re-forms (`driver.elastic`): re-dispatch it
    with the instance not excluded."""
    return elastic and prefill.num_ranks >= 2 and prefill.may_recover and GROUP_FAILED in message


def prefill_failed(prefill: Any, elastic: bool, message: str, lost: bool) -> Any:
    """The `PrefillFailed` of a call on instance `prefill` that failed with `message` (`lost`: its rank)."""
    from pdcluster.driver.dispatch import PrefillFailed

    return PrefillFailed(message, reforming=reforming(prefill, elastic, GROUP_FAILED if lost else message))


def prefill_lost(attempt: Any, prefill: Any, elastic: bool, reason: str, keep: Mapping | None) -> Any:
    """The `PrefillFailed` of `attempt`, pending on instance `prefill` that left routing for `reason`
    (`keep`: its surviving ranks, when it shrinks): re-dispatched to it again once it re-formed."""
    from pdcluster.driver.dispatch import PrefillFailed

    survives = f"; its rank {attempt.prefill.rank} survives" if keep and attempt.prefill.rank in keep else ""
    again = bool(keep) or reforming(prefill, elastic)
    return PrefillFailed(f"died or stopped answering ({reason}){survives}", reforming=again)


def shrink_bound_s(kv_timeout_s: float, probe_interval_s: float) -> float:
    """Seconds from a lost rank to its instance serving again at most: a probe round noticing it (at once
    for a dead rank; for a stalled one its missed probe plus two re-probes of its peers and the wait between
    them, `driver.elastic_loss`, or else its peers' collective timing out) plus the survivors'
    `reform_group` calls (their rendezvous, twice, and a call), in `ElasticInstances.shrink`."""
    from pdcluster.driver.dispatch import call_timeout_s, collective_timeout_s

    collective_s, call_s = collective_timeout_s(kv_timeout_s), call_timeout_s(kv_timeout_s)
    notice_s = max(collective_s + call_s, 4 * call_s)
    return probe_interval_s + notice_s + 2 * (2 * collective_s + call_s) + call_s


def held(decode: Any, attempt: Any) -> bool:
    """Decode holds `attempt`'s KV on `decode`, an instance out of routing that may re-form."""
    return decode.may_recover and not decode.routable and decode_has_it(attempt.state)


def kept(attempt: Any, index: int, keep: Mapping[int, int] | None) -> bool:
    """Whether `attempt` on decode instance `index` goes on: decode holds its KV on a rank of `keep` (old
    rank -> new rank); it is renumbered then."""
    if not keep or not decode_has_it(attempt.state) or attempt.decode.rank not in keep:
        return False
    attempt.decode = RankRef(index, keep[attempt.decode.rank])
    return True


async def wait_first(waits: set[Any], timeout_s: float, hold_s: float, holding: Callable[[], bool]) -> set:
    """`asyncio.wait(waits, timeout_s, FIRST_COMPLETED)`'s done set, waited on for up to `hold_s` more
    while `holding()` (the attempt's decode instance is re-forming)."""
    held_until_s = None
    while True:
        done, _ = await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        if done or not holding():
            return done
        held_until_s = held_until_s or time.monotonic() + hold_s
        if time.monotonic() > held_until_s:
            return done
