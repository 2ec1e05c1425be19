"""The driver's poll loop (`Dispatcher._poll`) against a scripted decode rank, in one event loop."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from pdcluster.driver.request_dispatch import Dispatcher


def test_the_poll_loop_ends_when_wait_for_swallowed_its_cancellation() -> None:
    """Python 3.11's `asyncio.wait_for` returns the result of a call that completed as the cancellation
    came and drops the CancelledError (CPython gh-86296). A poll loop that only stopped on that error then
    polled forever, and `asyncio.run` never returned (a deployment test hung in CI on it). The loop ends
    at its next turn instead, and makes no further call."""
    calls: list[int] = []

    async def events(_wait_s, _timeout_s):
        calls.append(1)
        if len(calls) == 1:  # what wait_for does on that race: cancelled, the call's result returned
            asyncio.current_task().cancel()
            try:
                await asyncio.sleep(0)
            except asyncio.CancelledError:
                pass
        else:  # later polls: a decode rank with nothing to say (a cancellation now would be delivered)
            await asyncio.sleep(0.01)
        return [], None

    client = SimpleNamespace(events=events)  # the rank's `RankClient`
    driver = SimpleNamespace(
        _closed=False,
        instances={"decode": [SimpleNamespace(routable=True, num_ranks=1, client=lambda rank: client)]},
        call_timeout_s=1.0,
        _loads=SimpleNamespace(update_decode=lambda *_: None),
        _by_handoff={},
    )

    async def run() -> bool:
        task = asyncio.ensure_future(Dispatcher._poll(driver, 0, 0))
        try:
            await asyncio.wait_for(asyncio.shield(task), 5.0)
        except asyncio.CancelledError:
            pass
        return task.cancelled()

    assert asyncio.run(run())
    assert calls == [1]
