"""A survivor's re-forming (`workers.elastic_rank.shrink`) that the driver gave up on (`abort_reform`): it
stops waiting for a peer that never comes at once, its engine's expert runtime untouched (over real gloo
groups in-process)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from pdcluster.driver.deployment import free_ports
from pdcluster.driver.messages import InstanceGroupSpec
from pdcluster.engine.expert_parallel import ExpertParallelRuntime, load_rank_shard
from pdcluster.engine.parallel import ParallelConfig
from pdcluster.models import bundled_checkpoint_dir
from pdcluster.workers.elastic_rank import shrink
from tests.orchestrator.test_elastic import _groups


def test_an_aborted_re_forming_raises_at_once_and_leaves_the_runtime_as_it_was() -> None:
    """EP3 lost rank 2; survivor 0 re-forms with survivor 1, which never comes; the driver aborts."""
    path = str(bundled_checkpoint_dir())
    group = _groups(3)[0]
    parallel = ParallelConfig(expert_parallel_size=3, rank=0, num_redundant_experts=1)
    model, placement = load_rank_shard(path, parallel, "cpu", torch.float32)
    runtime = ExpertParallelRuntime(model, parallel, group, placement)
    worker = SimpleNamespace(
        name="decode-0",
        engine=SimpleNamespace(ep=runtime, config=SimpleNamespace(model=path)),
        _group_error="gloo: connection closed by peer",  # (its old group failed)
        _aborted_reforms=set(),
    )
    ports = free_ports("127.0.0.1", 2)
    spec = InstanceGroupSpec(0, 2, f"tcp://127.0.0.1:{ports[0]}", ports[1], "gloo", 10.0, 60.0, "secret-1")
    threading.Timer(0.3, worker._aborted_reforms.add, ("secret-1",)).start()
    started_s = time.monotonic()
    with pytest.raises(RuntimeError, match="aborted"):
        shrink(worker, spec, [2], None)
    assert time.monotonic() - started_s < spec.rendezvous_timeout_s / 2
    assert worker.engine.ep is runtime and runtime.placement is placement
    assert worker._group_error is not None  # still failed: the driver's next try re-forms it
