"""`RayRankClient.prefill`'s two calls: the first token always comes first, failures reach both replies."""

from __future__ import annotations

import asyncio
import concurrent.futures
from types import SimpleNamespace

import pytest

from pdcluster.driver.rank_client import RayRankClient


class _Method:
    """A fake actor method: each `.remote()` returns a ref whose `future()` the test completes."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.futures: list[concurrent.futures.Future] = []

    def remote(self, *args):
        self.calls.append(args)
        future: concurrent.futures.Future = concurrent.futures.Future()
        self.futures.append(future)
        return SimpleNamespace(future=lambda: future)


def _client() -> tuple[RayRankClient, SimpleNamespace]:
    actor = SimpleNamespace(prefill_first=_Method(), prefill_result=_Method())
    return RayRankClient(actor, ordered=True), actor


async def _passes(n: int = 5) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


def test_a_result_that_comes_before_the_first_token_waits_for_it() -> None:
    async def go():
        client, actor = _client()
        call = client.prefill(SimpleNamespace(handoff_id="h1"), timeout_s=10.0)
        first_seq = actor.prefill_first.calls[0][1].seq
        assert actor.prefill_result.calls[0] == ("h1", actor.prefill_result.calls[0][1])
        assert actor.prefill_result.calls[0][1].seq == first_seq + 1  # ordered after its prefill
        actor.prefill_result.futures[0].set_result("result")
        await _passes()
        assert not call.first.done() and not call.result.done()
        actor.prefill_first.futures[0].set_result("token")
        assert await call.result == "result"
        assert call.first.result() == "token"

    asyncio.run(go())


def test_a_failed_prefill_fails_both_replies() -> None:
    async def go():
        client, actor = _client()
        call = client.prefill(SimpleNamespace(handoff_id="h2"), timeout_s=10.0)
        actor.prefill_result.futures[0].set_exception(RuntimeError("prefill of h2 failed"))
        with pytest.raises(RuntimeError, match="h2 failed"):
            await call.result
        with pytest.raises(RuntimeError, match="h2 failed"):
            await call.first
        actor.prefill_first.futures[0].set_exception(RuntimeError("late"))  # settles nothing now
        await _passes()

    asyncio.run(go())


def test_a_result_not_back_within_its_timeout_raises_timeout_error() -> None:
    async def go():
        client, actor = _client()
        call = client.prefill(SimpleNamespace(handoff_id="h3"), timeout_s=0.01)
        actor.prefill_first.futures[0].set_result("token")
        assert await call.first == "token"
        with pytest.raises(TimeoutError):
            await call.result
        actor.prefill_result.futures[0].set_result("too late")  # settles nothing now
        await _passes()

    asyncio.run(go())


def test_a_cancelled_call_cancels_its_first_reply() -> None:
    async def go():
        client, actor = _client()
        call = client.prefill(SimpleNamespace(handoff_id="h4"), timeout_s=10.0)
        call.result.cancel()
        await _passes()
        assert call.first.cancelled()
        actor.prefill_first.futures[0].set_result("token")
        actor.prefill_result.futures[0].set_result("result")
        await _passes()

    asyncio.run(go())


def test_a_first_reply_that_fails_before_the_last_is_the_call_failing() -> None:
    """The dispatcher takes a failed first reply as the prefill call's failure, whether or not the last
    reply has failed yet (a killed actor's two replies fail one after the other)."""
    from pdcluster.driver.dispatch import PrefillFailed
    from pdcluster.driver.request_dispatch import Dispatcher

    async def go():
        client, actor = _client()
        call = client.prefill(SimpleNamespace(handoff_id="h3"), timeout_s=10.0)
        actor.prefill_first.futures[0].set_exception(RuntimeError("the actor process died"))
        await _passes()
        assert call.first.done() and not call.result.done()
        dispatcher = object.__new__(Dispatcher)
        dispatcher.event_timeout_s = 10.0
        dispatcher.registry = SimpleNamespace(instances={"prefill": [SimpleNamespace(index=0, num_ranks=1)]})
        dispatcher._elastic_prefill = False
        attempt = SimpleNamespace(
            first_reported=False, prefill_reported=False, prefill_first=call.first, prefill_index=0
        )
        outcome = dispatcher._prefill_outcome(attempt, call.result)
        assert outcome == PrefillFailed("RuntimeError: the actor process died")
        assert attempt.first_reported and attempt.prefill_reported
        actor.prefill_result.futures[0].set_exception(RuntimeError("the actor process died"))
        await _passes()
        assert call.result.done()

    asyncio.run(go())
