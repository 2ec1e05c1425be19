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


def confirmed_rank_loss(
    ray,
    instance: Instance,
    outcomes: Sequence[Any],
    stall_s: float,
    call_timeout_s: float,
    sent: dict[int, tuple[Any, float]] | None = None,
) -> tuple[RankLoss | None, list[Any]]:
    """The `RankLoss` of `outcomes` and the outcomes used. Unless every silent rank died, the answering ranks
    are probed again (now, and when their wait may reach `stall_s`) and each silent one once more (`sent`:
    rank -> (ref, monotonic time sent), not sent again), lost once unanswered for `reprobe_wait_s`."""
    died = ray.exceptions.ActorDiedError
    loss = find_rank_loss(instance, outcomes, stall_s)
    if (loss is None and not maybe_stalled(outcomes)) or (
        loss is not None and all(isinstance(outcomes[r], died) for r in loss.lost)
    ):
        return loss, list(outcomes)
    answered = [r for r, o in enumerate(outcomes) if not isinstance(o, BaseException)]
    fresh = probe_silent(ray, instance, outcomes, sent)
    silent = {r: ref for r, (ref, _) in fresh.items()}
    heard_by_s = max((s for _, s in fresh.values()), default=0.0) + reprobe_wait_s(stall_s, call_timeout_s)
    again = list(outcomes)
    for round_ in range(2):
        refs = {r: _probe(instance, r) for r in answered}
        for r, ref in refs.items():
            again[r] = _answer(ray, ref, call_timeout_s)
        _hear(ray, silent, again, 0.0)
        if find_rank_loss(instance, again, stall_s):  # before a silent rank counts as lost: its full wait
            _hear(ray, silent, again, max(0.0, heard_by_s - time.monotonic()))
        if round_ or find_rank_loss(instance, again, stall_s) or not maybe_stalled(again):
            break
        waiting = [o for o in again if not isinstance(o, BaseException) and o.instance_group_error is None]
        blocked = [blocked_s(o) for o in waiting]
        sleep_s = max(0.0, stall_s - min(blocked, default=stall_s)) + 0.05
        if silent:
            _hear(ray, silent, again, sleep_s)
        else:
            time.sleep(sleep_s)
    return find_rank_loss(instance, again, stall_s), again


def reprobe_wait_s(stall_s: float, call_timeout_s: float) -> float:
    """How long a silent rank's fresh probe must go unanswered: half the probe round's first wait."""
    return min(stall_s, call_timeout_s) / 2


def probe_silent(
    ray, instance: Instance, outcomes: Sequence[Any], sent: dict[int, tuple[Any, float]] | None = None
) -> dict[int, tuple[Any, float]]:
    """A fresh probe of each rank of `instance` whose `outcomes` entry is an exception other than its death
    (those in `sent` keep theirs), when another rank answered: rank -> (ref, monotonic time sent)."""
    died, now_s, sent = ray.exceptions.ActorDiedError, time.monotonic(), sent or {}
    if all(isinstance(o, BaseException) for o in outcomes):
        return {}
    return {
        r: sent.get(r) or (_probe(instance, r), now_s)
        for r, o in enumerate(outcomes)
        if isinstance(o, BaseException) and not isinstance(o, died)
    }


def _probe(instance: Instance, r: int) -> Any:
    """A `load` call to rank `r` of `instance` on the actor's probe concurrency group: its ref."""
    from pdcluster.driver.rank_actors import PROBE_GROUP

    return instance.ranks[r].load.options(concurrency_group=PROBE_GROUP).remote()


def _answer(ray, ref: Any, timeout_s: float) -> Any:
    try:
        return ray.get(ref, timeout=timeout_s)
    except Exception as e:  # noqa: BLE001 - this rank's outcome now
        return e


def _hear(ray, silent: dict[int, Any], outcomes: list[Any], timeout_s: float) -> None:
    """Put the answers of the `silent` probes that came within `timeout_s` into `outcomes` (and drop them)."""
    if not silent:
        return
    ready, _ = ray.wait(list(silent.values()), num_returns=len(silent), timeout=timeout_s)
    for r in [r for r, ref in silent.items() if ref in ready]:
        outcomes[r] = _answer(ray, silent.pop(r), 0.0)
