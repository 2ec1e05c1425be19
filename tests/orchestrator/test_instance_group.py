"""Joining a multi-rank instance's group (`driver.instance_group`) in-process, one thread per rank:
every rank joins; a rank that never comes fails the others at the barrier within its timeout; a malformed
rendezvous is refused; a process without the rendezvous secret can neither join nor disturb the group."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from pdcluster.driver.deployment import free_ports
from pdcluster.driver.instance_group import join_instance_group, new_rendezvous_secret
from pdcluster.driver.messages import InstanceGroupSpec

SECRET = new_rendezvous_secret()
TIMEOUT_S = 3.0  # the barrier's rendezvous timeout in the tests that wait for it


def _spec(
    rank: int, num_ranks: int, ports: list[int], rendezvous_timeout_s: float = 30.0, secret: str = SECRET
) -> InstanceGroupSpec:
    return InstanceGroupSpec(
        rank=rank,
        num_ranks=num_ranks,
        init_method=f"tcp://127.0.0.1:{ports[0]}",
        barrier_port=ports[1],
        backend="gloo",
        timeout_s=10.0,
        rendezvous_timeout_s=rendezvous_timeout_s,
        secret=secret,
    )


def _join_all(num_ranks: int, ports: list[int], ranks: range, secrets: dict[int, str] | None = None):
    """Join ranks `ranks` at once, rank r with `secrets[r]` (default: SECRET); rank -> group or error."""
    results: dict[int, object] = {}

    def join(rank: int) -> None:
        secret = (secrets or {}).get(rank, SECRET)
        try:
            results[rank] = join_instance_group(_spec(rank, num_ranks, ports, TIMEOUT_S, secret))
        except Exception as e:  # noqa: BLE001 - reported to the test
            results[rank] = e

    threads = [threading.Thread(target=join, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


def test_every_rank_joins_and_the_group_reduces_over_all() -> None:
    results = _join_all(3, free_ports("127.0.0.1", 2), range(3))
    assert sorted(results) == [0, 1, 2]
    assert [results[r].rank for r in range(3)] == [0, 1, 2] and results[0].num_ranks == 3
    values = {r: torch.tensor([float(r + 1)]) for r in range(3)}
    works = [results[r].group.allreduce([values[r]]) for r in range(3)]
    for work in works:
        work.wait()
    assert all(v.item() == 6.0 for v in values.values())  # 1 + 2 + 3, exact in float32


def test_a_rank_that_never_comes_fails_the_others_within_the_rendezvous_timeout() -> None:
    started_s = time.monotonic()
    results = _join_all(2, free_ports("127.0.0.1", 2), range(1))  # rank 1 never starts
    assert isinstance(results[0], RuntimeError), results
    assert time.monotonic() - started_s < 10 * TIMEOUT_S  # (generous slack: a busy machine)


def test_a_malformed_rendezvous_is_refused() -> None:
    spec = _spec(0, 2, [1, 2])
    with pytest.raises(ValueError, match="tcp://host:port"):
        join_instance_group(InstanceGroupSpec(**{**spec.__dict__, "init_method": "env://"}))
    with pytest.raises(ValueError, match=r"rank 2 is not in \[0, 2\)"):
        join_instance_group(InstanceGroupSpec(**{**spec.__dict__, "rank": 2}))
    with pytest.raises(ValueError, match="no rendezvous secret"):
        join_instance_group(InstanceGroupSpec(**{**spec.__dict__, "secret": ""}))


def test_a_process_without_the_secret_can_neither_join_nor_disturb_the_group() -> None:
    """A stranger that knows the ports (not the secret) takes rank 1's place with a guessed secret, then
    writes the keys an unauthenticated barrier would use: rank 0 does not form a group with it; with the
    real rank 1 the group forms and reduces over the two of them."""
    ports = free_ports("127.0.0.1", 2)
    results = _join_all(2, ports, range(2), secrets={1: new_rendezvous_secret()})
    assert isinstance(results[0], RuntimeError) and isinstance(results[1], RuntimeError), results
    ports = free_ports("127.0.0.1", 2)
    results = {}

    def join(rank: int) -> None:
        results[rank] = join_instance_group(_spec(rank, 2, ports, TIMEOUT_S))

    first = threading.Thread(target=join, args=(0,))
    first.start()  # rank 0 hosts the store and waits at the barrier; the stranger writes meanwhile
    store = dist.TCPStore("127.0.0.1", ports[1], 2, is_master=False, timeout=timedelta(seconds=TIMEOUT_S))
    for key in ("rank0", "rank1", "loaded0", "instance/0", "instance/1"):
        store.set(key, "ready")
    second = threading.Thread(target=join, args=(1,))
    second.start()
    for t in (first, second):
        t.join(60)
    assert sorted(results) == [0, 1], results
    values = [torch.ones(1), torch.ones(1)]
    for work in [results[r].group.allreduce([values[r]]) for r in range(2)]:
        work.wait()
    assert [v.item() for v in values] == [2.0, 2.0]
