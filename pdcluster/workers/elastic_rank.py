"""A rank's side of elastic expert parallelism (the driver's: `driver.elastic`): `shrink` re-forms the group
over the survivors of a failed one, which split the experts; `grow` meets new ranks, serves while they load
and switches after the step whose agreement found every survivor ready. Both keep this rank's engine, KV
cache and requests."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from pdcluster.driver.messages import InstanceGroupSpec

if TYPE_CHECKING:
    from pdcluster.workers.rank import RankWorker

logger = logging.getLogger(__name__)

# Given-up groups, kept (time.monotonic() when given up, group) until their blocked collectives timed out:
# destroying a gloo group joins its threads, and does so holding the GIL, freezing this process meanwhile.
_given_up: list[tuple[float, Any]] = []


def _engine_locked(worker: RankWorker):
    """The engine lock (decode: `_locked`); prefill's engine thread does not step while `_group_error`."""
    return getattr(worker, "_locked", contextlib.nullcontext)()


def _renamed(worker: RankWorker, rank: int) -> str:
    """`decode-0.1` as rank 0 becomes `decode-0`; as rank 1 of `decode-0`, `decode-0.1`."""
    base = worker.name.split(".")[0]
    return base if rank == 0 else f"{base}.{rank}"


def shrink(worker: RankWorker, spec: InstanceGroupSpec, lost_ranks: list[int], max_local_experts: int | None):
    """Join the survivors' new group `spec` (collective over them) once this rank's old group failed, and
    take this rank's share of the shrunk placement (`engine.elastic_ep.shrink_runtime`). Returns
    `{"rank", "num_ranks", "num_local_experts", "loaded_experts"}`. Raises PlacementRefused: the survivors
    cannot hold every logical expert (checked before joining); RuntimeError: the old group has not failed
    within twice its collective timeout, the new one could not be formed, or `abort_reform` ended it."""
    from pdcluster.driver.instance_group import form_group, meet, wait_until_loaded
    from pdcluster.engine.elastic_ep import plan_shrink, shrink_runtime
    from pdcluster.models.ep_dispatch import WAITS
    from pdcluster.workers.rank import ep_summary

    def aborted() -> bool:
        return spec.secret in worker._aborted_reforms

    runtime, lost = worker.engine.ep, frozenset(lost_ranks)
    if runtime is None:
        raise RuntimeError(f"{worker.name}: not an expert-parallel rank")
    plan_shrink(runtime, lost, max_local_experts)
    WAITS.abandon()  # a collective blocked on the lost ranks (or a peer blocked on them) gives up now
    deadline_s = time.monotonic() + 2 * runtime.parallel.collective_timeout_s
    while worker._group_error is None:  # (set by the engine thread once it stopped stepping)
        if aborted():
            raise RuntimeError(f"{worker.name}: re-forming aborted by the driver")
        if time.monotonic() > deadline_s:
            raise RuntimeError(f"{worker.name}: its instance group has not failed; nothing to re-form")
        time.sleep(0.05)
    with _engine_locked(worker):
        joined = form_group(spec, meet(spec, aborted))
        try:
            WAITS.watch(joined.group)
            new, shrunk = shrink_runtime(
                runtime, joined.group, lost, max_local_experts, worker.engine.config.model
            )
            wait_until_loaded(joined, spec.rendezvous_timeout_s, aborted)
        except BaseException:  # aborted, or a peer never loaded: this group is given up too
            _keep_given_up(joined, 2 * runtime.parallel.collective_timeout_s)
            raise
        loaded = sum(1 for _, r, _, _ in shrunk.loads if r == spec.rank)
        _keep_given_up(worker.instance_group, 2 * runtime.parallel.collective_timeout_s)
        _switch(worker, spec, joined, new)
        worker._ep_summary = ep_summary(worker.engine)
        worker._group_error = None
    worker._wake_engine_thread()
    return _reported(worker, f"re-formed after losing ranks {sorted(lost)}", spec, new, loaded)


def _keep_given_up(old_group: Any, timeout_s: float) -> None:
    """Keep `old_group` alive for `timeout_s` seconds (see `_given_up`); let go of those kept longer."""
    now_s = time.monotonic()
    _given_up[:] = [(s, g) for s, g in _given_up if now_s - s < timeout_s] + [(now_s, old_group)]


def grow(worker: RankWorker, spec: InstanceGroupSpec, num_redundant_experts: int, attempt: int) -> dict:
    """Meet the new ranks of group `spec` (after the survivors' ids), serve while they load, then switch to
    it with `ExpertPlacement.default` (`elastic_ep.grow_runtime`) after the first step whose agreement over
    the old group found every survivor ready (`engine.grow_vote`). Returns as `shrink`.
    Raises RuntimeError: `abort_grow(attempt)` was called or this rank's current group failed before the
    survivors agreed, or the new ranks did not come within the rendezvous timeout."""
    from pdcluster.driver.instance_group import form_group, meet, wait_until_loaded
    from pdcluster.engine.elastic_ep import grow_runtime
    from pdcluster.engine.grow_vote import GrowVote

    def aborted() -> bool:
        return attempt in worker._aborted_grows or worker._group_error is not None

    runtime = worker.engine.ep
    if runtime is None:
        raise RuntimeError(f"{worker.name}: not an expert-parallel rank")
    joined = form_group(spec, meet(spec, aborted))
    wait_until_loaded(joined, spec.rendezvous_timeout_s, aborted)
    grown, vote = [], GrowVote()

    def switch() -> None:
        worker._checkpoint("grow")
        engine = worker.engine
        grown.extend(grow_runtime(engine.ep, joined.group, num_redundant_experts, engine.config.model))
        _switch(worker, spec, joined, grown[0])

    runtime.grow_vote = worker._grow_votes[attempt] = vote
    try:
        if aborted():  # (`abort_grow` came before the vote was registered)
            vote.abort()
        _at_agreed_step(worker, vote, switch, spec.timeout_s, aborted)
    except BaseException:  # not switched: the grown group is given up
        _keep_given_up(joined, 2 * spec.timeout_s)
        raise
    finally:
        runtime.grow_vote = None
        del worker._grow_votes[attempt]
    new, loaded = grown
    return _reported(worker, "grew", spec, new, loaded)


def _reported(worker: RankWorker, what: str, spec: InstanceGroupSpec, new: Any, loaded: int) -> dict:
    """Log the change to the group and return what `shrink` and `grow` return."""
    slots = new.placement.num_local_experts
    logger.warning(
        "%s: %s: now rank %d of %d; %d expert slots per MoE layer, %d read from the checkpoint",
        *(worker.name, what, spec.rank, spec.num_ranks, slots, loaded),
    )
    return {
        "rank": spec.rank,
        "num_ranks": spec.num_ranks,
        "num_local_experts": slots,
        "loaded_experts": loaded,
    }


def _at_agreed_step(worker: RankWorker, vote, fn, timeout_s: float, aborted) -> None:
    """Vote ready, then run `fn` on the engine thread before the step after the one whose agreement set
    `vote.agreed` (lockstep makes it step even with nothing to run). Raises what `fn` raised, or
    RuntimeError when `aborted()` or `timeout_s` passed before that agreement (the vote withdrawn first)."""
    engine, lock, done, error = worker.engine, threading.Lock(), threading.Event(), []
    lockstep = worker.lockstep

    def step(*args, **kwargs):
        with lock:
            if "step" in vars(engine) and vote.agreed:
                del engine.step
                try:
                    fn()
                except BaseException as e:  # noqa: BLE001 - handed to the caller; this step goes on
                    error.append(e)
                    worker.lockstep = lockstep
                done.set()
        return type(engine).step(engine, *args, **kwargs)

    def unhook() -> None:
        with lock:
            if "step" in vars(engine):
                del engine.step
                worker.lockstep = lockstep

    engine.step = step
    worker.lockstep = True
    vote.ready()  # (after the hook: the step after any agreement runs through it)
    worker._wake_engine_thread()
    deadline_s, why = time.monotonic() + timeout_s, None
    while why is None and not done.wait(0.05):
        why = "growing was aborted" if vote.aborted or aborted() else None
        if why is None and time.monotonic() > deadline_s:
            why = f"the survivors did not agree to switch within {timeout_s:g} s"
    if why is not None and vote.withdraw(2 * timeout_s):
        unhook()
        raise RuntimeError(f"{worker.name}: {why}")
    if not done.wait(2 * timeout_s):  # agreed: every survivor switches before its next step
        unhook()
        raise RuntimeError(f"{worker.name}: no step after the survivors agreed to switch")
    if error:
        raise error[0]


def _switch(worker: RankWorker, spec: InstanceGroupSpec, joined, runtime) -> None:
    """Under the engine lock: the engine steps on `runtime` over `joined` from its next step."""
    worker.engine.ep, worker.instance_group, worker.group_spec = runtime, joined, spec
    worker.lockstep = spec.num_ranks > 1
    worker.name = _renamed(worker, spec.rank)
