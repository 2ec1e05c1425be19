"""One local Ray session per test module (clusters are deployed into it and torn down per test)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def ray_session():
    ray = pytest.importorskip("ray")
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield ray
    if started:
        ray.shutdown()
