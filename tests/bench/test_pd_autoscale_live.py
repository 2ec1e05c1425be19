"""bench.pd_autoscale_live's deploy files and bench.pd_autoscale's thinning (the live replays themselves
deploy four clusters: run by hand, `python -m bench.pd_autoscale --live`)."""

from __future__ import annotations

import pytest

from bench.pd_autoscale import BENCH_AUTOSCALE, thinned
from bench.pd_autoscale_live import NUM_DEVICES, topology_file
from pdcluster.config import load_topology


@pytest.mark.parametrize(("num_prefill", "autoscale"), [(2, True), (1, False), (3, False)])
def test_topology_file_is_the_split(tmp_path, num_prefill, autoscale):
    topology = load_topology(str(topology_file(tmp_path, num_prefill, autoscale)))
    assert topology.hardware.devices_per_node == NUM_DEVICES
    assert (topology.prefill.num_instances, topology.decode.num_instances) == (
        num_prefill,
        NUM_DEVICES - num_prefill,
    )
    assert (topology.prefill.devices_per_instance, topology.decode.devices_per_instance) == (1, 1)
    assert topology.autoscale.enabled is autoscale
    if autoscale:
        assert {k: getattr(topology.autoscale, k) for k in BENCH_AUTOSCALE} == BENCH_AUTOSCALE


def test_thinned_keeps_evenly_spaced_requests_in_order():
    assert thinned(list(range(10)), 4) == [0, 2, 5, 7]
    assert thinned(list(range(3)), 5) == [0, 1, 2]
    assert thinned(list(range(3)), None) == [0, 1, 2]
