"""`FairLock`: mutual exclusion, and a waiter queued before the holder asks again is served first (a
decode rank's engine thread re-taking its lock step after step must not starve a reserve)."""

from __future__ import annotations

import threading
import time

import pytest

from pdcluster.driver.fair_lock import FairLock

WAIT_S = 10.0  # bound on each wait below; every wait ends as soon as its condition holds


def _wait_until(condition) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def test_a_waiter_is_served_before_the_holder_takes_the_lock_again() -> None:
    lock, order = FairLock(), []

    def waiter() -> None:
        with lock:
            order.append("waiter")

    lock.acquire()
    thread = threading.Thread(target=waiter)
    thread.start()
    _wait_until(lambda: lock.num_waiting == 1)
    lock.release()
    with lock:  # asked after the waiter: granted after it, however quickly it is asked
        order.append("holder again")
    thread.join(WAIT_S)
    assert order == ["waiter", "holder again"]


def test_requests_are_granted_in_order_and_exclusively() -> None:
    lock, order = FairLock(), []
    holders = {"now": 0, "max": 0}

    def critical(i: int) -> None:
        with lock:
            holders["now"] += 1
            holders["max"] = max(holders["max"], holders["now"])
            order.append(i)
            time.sleep(0.001)  # give another thread the chance to break in, were it able to
            holders["now"] -= 1

    lock.acquire()
    threads = []
    for i in range(5):
        thread = threading.Thread(target=critical, args=(i,))
        thread.start()
        _wait_until(lambda n=i + 1: lock.num_waiting == n)  # each queued before the next starts
        threads.append(thread)
    lock.release()
    for thread in threads:
        thread.join(WAIT_S)
    assert order == [0, 1, 2, 3, 4]
    assert holders["max"] == 1 and not lock.locked() and lock.num_waiting == 0


def test_release_by_a_thread_that_does_not_hold_it_raises() -> None:
    lock = FairLock()
    with pytest.raises(RuntimeError, match="does not hold"):
        lock.release()
    lock.acquire()
    errors = []
    thread = threading.Thread(target=lambda: _release_into(lock, errors))
    thread.start()
    thread.join(WAIT_S)
    assert errors and lock.locked()
    lock.release()


def _release_into(lock: FairLock, errors: list[Exception]) -> None:
    try:
        lock.release()
    except RuntimeError as e:
        errors.append(e)


def _interrupt(thread: threading.Thread) -> None:
    """Raise KeyboardInterrupt in `thread` when it next runs Python code (CPython's async exception)."""
    import ctypes

    done = ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread.ident), ctypes.py_object(KeyboardInterrupt)
    )
    assert done == 1


@pytest.mark.parametrize("interrupted", [0, 1])
def test_an_interrupted_waiter_never_stalls_the_queue(interrupted: int) -> None:
    """Two waiters queue; one gets KeyboardInterrupt while it waits (the first, whose turn comes next, or
    the second, whose turn has not come): the other still gets the lock, and the lock ends free."""
    lock, got, raised = FairLock(), [], []

    def waiter(i: int) -> None:
        try:
            with lock:
                got.append(i)
        except KeyboardInterrupt:
            raised.append(i)

    lock.acquire()
    threads = []
    for i in range(2):
        thread = threading.Thread(target=waiter, args=(i,))
        thread.start()
        _wait_until(lambda n=i + 1: lock.num_waiting == n)
        threads.append(thread)
    _interrupt(threads[interrupted])  # delivered when it wakes, at the release below
    lock.release()
    for thread in threads:
        thread.join(WAIT_S)
    assert raised == [interrupted] and got == [1 - interrupted]
    assert not lock.locked() and lock.num_waiting == 0
    with lock:  # and it is still a working lock
        assert lock.locked()
