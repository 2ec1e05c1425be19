"""Joining a multi-rank instance's group (`driver.instance_group`) in-process, one thread per rank:
every rank joins; a rank that never comes fails the others at the barrier within its timeout; a malformed
rendezvous is refused."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from pdcluster.driver.deployment import free_ports
from pdcluster.driver.instance_group import join_instance_group
from pdcluster.driver.messages import InstanceGroupSpec


def _spec(
    rank: int, num_ranks: int, ports: list[int], rendezvous_timeout_s: float = 30.0
) -> InstanceGroupSpec:
    return InstanceGroupSpec(
        rank=rank,
        num_ranks=num_ranks,
        init_method=f"tcp://127.0.0.1:{ports[0]}",
        barrier_port=ports[1],
        backend="gloo",
        timeout_s=10.0,
        rendezvous_timeout_s=rendezvous_timeout_s,
    )


def _join_all(num_ranks: int, ports: list[int], ranks: range) -> dict[int, object]:
    results: dict[int, object] = {}

    def join(rank: int) -> None:
        try:
            results[rank] = join_instance_group(_spec(rank, num_ranks, ports, rendezvous_timeout_s=3.0))
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
    assert time.monotonic() - started_s < 10 * 3.0  # the 3 s barrier timeout (generous slack: a busy machine)


def test_a_malformed_rendezvous_is_refused() -> None:
    spec = _spec(0, 2, [1, 2])
    with pytest.raises(ValueError, match="tcp://host:port"):
        join_instance_group(InstanceGroupSpec(**{**spec.__dict__, "init_method": "env://"}))
    with pytest.raises(ValueError, match=r"rank 2 is not in \[0, 2\)"):
        join_instance_group(InstanceGroupSpec(**{**spec.__dict__, "rank": 2}))
