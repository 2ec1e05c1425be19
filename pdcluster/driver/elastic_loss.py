"""Telling a lost rank of a multi-rank instance from the health monitor's probes (`driver.elastic`): a dead
rank at once; a stalled one once it missed probes for `stall_s` (its pool's `elastic_stall_s`) while every
peer that answered has been blocked in one collective as long (or saw the group fail). A slow rank is not
lost."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pdcluster.driver.actor_errors import describe_error
from pdcluster.driver.instance import Instance


@dataclass(frozen=True)
class RankLoss:
    """One event: ranks `lost` of instance `role`-`index` are gone; `survivors` (old rank ids) answered."""

    role: str
    index: int
    lost: tuple[int, ...]
    survivors: tuple[int, ...]
    why: str


def find_rank_loss(instance: Instance, outcomes: Sequence[Any], stall_s: float) -> RankLoss | None:
    """The `RankLoss` of one probe round (`outcomes[r]`: rank r's load or its probe's exception), or None:
    all or none answered, or a silent rank's peers are not (yet) blocked `stall_s` in one collective."""
    import ray

    died = ray.exceptions.ActorDiedError
    answered = [r for r, o in enumerate(outcomes) if not isinstance(o, BaseException)]
    lost = tuple(r for r in range(len(outcomes)) if r not in answered)
    if not answered or not lost:
        return None
    if not all(isinstance(outcomes[r], died) for r in lost) and not all(
        outcomes[r].instance_group_error is not None or blocked_s(outcomes[r]) >= stall_s for r in answered
    ):
        return None
    why = "; ".join(
        f"rank {r} {'died' if isinstance(outcomes[r], died) else 'stopped answering'} "
        f"({describe_error(outcomes[r])})"
        for r in lost
    )
    return RankLoss(instance.role, instance.index, lost, tuple(answered), why)


def blocked_s(load: Any) -> float:
    """Seconds the rank of `load` has been blocked in one collective of its group (0.0: not blocked)."""
    return getattr(load, "collective_wait_s", 0.0)


def maybe_stalled(outcomes: Sequence[Any]) -> bool:
    """A rank did not answer while every rank that did is blocked in a collective (or saw it fail)."""
    answered = [o for o in outcomes if not isinstance(o, BaseException)]
    return 0 < len(answered) < len(outcomes) and all(
        o.instance_group_error is not None or blocked_s(o) > 0 for o in answered
    )


def probe_again(
    ray, instance: Instance, outcomes: Sequence[Any], stall_s: float, call_timeout_s: float
) -> list[Any]:
    """`outcomes` with the answering ranks probed again (now, and when their wait may reach `stall_s`)."""
    from pdcluster.driver.rank_actors import PROBE_GROUP

    answered = [r for r, o in enumerate(outcomes) if not isinstance(o, BaseException)]
    again = list(outcomes)
    for probe in range(2):
        refs = {r: instance.ranks[r].load.options(concurrency_group=PROBE_GROUP) for r in answered}
        refs = {r: load.remote() for r, load in refs.items()}
        for r, ref in refs.items():
            try:
                again[r] = ray.get(ref, timeout=call_timeout_s)
            except Exception as e:  # noqa: BLE001 - this rank's outcome now
                again[r] = e
        if probe or find_rank_loss(instance, again, stall_s) or not maybe_stalled(again):
            break
        waiting = [o for o in again if not isinstance(o, BaseException) and o.instance_group_error is None]
        blocked = [blocked_s(o) for o in waiting]
        time.sleep(max(0.0, stall_s - min(blocked, default=stall_s)) + 0.05)
    return again
