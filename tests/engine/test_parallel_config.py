"""`ParallelConfig` validation, EP refusals at config time, and a one-rank instance group (in-process)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from pdcluster.engine.config import EngineConfig
from pdcluster.engine.llm_engine import LLMEngine
from pdcluster.engine.local_ranks import free_port
from pdcluster.engine.parallel import ParallelConfig, make_instance_group
from pdcluster.models import bundled_checkpoint_dir

CKPT = str(bundled_checkpoint_dir())


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"expert_parallel_size": 0}, "expert_parallel_size"),
        ({"expert_parallel_size": 2, "rank": 2}, "rank"),
        ({"expert_parallel_size": 2, "data_parallel_size": 4}, "data_parallel_size"),
        ({"num_redundant_experts": -1}, "num_redundant_experts"),
        ({"eplb_interval_steps": 0}, "eplb_interval_steps"),
        ({"eplb_window_steps": 0}, "eplb_window_steps"),
        ({"expert_parallel_size": 4, "eplb_num_nodes": 3}, "eplb_num_nodes"),
        ({"collective_timeout_s": 0}, "collective_timeout_s"),
    ],
)
def test_bad_parallel_config_names_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"'{field}'"):
        ParallelConfig(**kwargs)


def test_async_scheduling_is_refused_with_ep() -> None:
    with pytest.raises(ValueError, match="'async_scheduling'.*expert parallelism"):
        EngineConfig(CKPT, async_scheduling=True, parallel=ParallelConfig(expert_parallel_size=2))
    EngineConfig(CKPT, async_scheduling=True)  # one device: fine


def test_ep_engine_needs_a_group_and_a_fitting_expert_count() -> None:
    with pytest.raises(ValueError, match="needs the instance process group"):
        LLMEngine(EngineConfig(CKPT, parallel=ParallelConfig(expert_parallel_size=2)))
    group = make_instance_group("127.0.0.1", free_port(), 0, 1, timeout_s=10)
    parallel = ParallelConfig(expert_parallel_size=1)
    assert not parallel.enabled  # one rank: the plain engine, no runtime
    assert LLMEngine(EngineConfig(CKPT, num_kv_blocks=8, parallel=parallel), group=group).ep_stats() is None


def test_instance_group_without_the_default_group() -> None:
    group = make_instance_group("127.0.0.1", free_port(), 0, 1, timeout_s=10)
    assert not dist.is_initialized()  # no default process group was made
    t = torch.tensor([3])
    group.allreduce([t]).wait()
    assert t.tolist() == [3] and (group.rank(), group.size()) == (0, 1)
    with pytest.raises(ValueError, match="unknown process group backend"):
        make_instance_group("127.0.0.1", free_port(), 0, 1, backend="mpi")
