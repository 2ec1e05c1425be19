"""Expert-parallel instances: the parallel settings, and the instance's own process group."""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch.distributed as dist

BACKENDS = ("gloo", "nccl", "hccl")


@dataclass(frozen=True)
class ParallelConfig:
    """Parallel layout of one instance, as seen by one of its ranks (picklable; one per rank actor)."""

    expert_parallel_size: int = 1
    rank: int = 0
    data_parallel_size: int | None = None
    num_redundant_experts: int = 0
    eplb_interval_steps: int | None = None
    eplb_window_steps: int = 64
    eplb_num_nodes: int = 1
    collective_timeout_s: float = 60.0
    enable_micro_batch_overlap: bool = False

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"parallel argument {name!r}: {why} (got {getattr(self, name)!r})")

        if self.expert_parallel_size < 1:
            raise bad("expert_parallel_size", "must be >= 1")
        if not 0 <= self.rank < self.expert_parallel_size:
            raise bad("rank", f"must be in [0, expert_parallel_size={self.expert_parallel_size})")
        if self.data_parallel_size is not None and self.data_parallel_size != self.expert_parallel_size:
            raise bad(
                "data_parallel_size",
                f"must equal expert_parallel_size {self.expert_parallel_size} (attention is data-parallel "
                "over the EP ranks; tensor_parallel_size > 1 is not supported)",
            )
        if self.num_redundant_experts < 0:
            raise bad("num_redundant_experts", "must be >= 0")
        if self.eplb_interval_steps is not None and self.eplb_interval_steps < 1:
            raise bad("eplb_interval_steps", "must be >= 1 or None (off)")
        if self.eplb_window_steps < 1:
            raise bad("eplb_window_steps", "must be >= 1")
        if self.eplb_num_nodes < 1 or self.expert_parallel_size % self.eplb_num_nodes:
            raise bad("eplb_num_nodes", "must be >= 1 and divide expert_parallel_size")
        if not self.collective_timeout_s > 0:
            raise bad("collective_timeout_s", "must be > 0")

    @property
    def enabled(self) -> bool:
        """True when the instance has more than one rank."""
        return self.expert_parallel_size > 1


def make_instance_group(
    host: str,
    port: int,
    rank: int,
    world_size: int,
    backend: str = "gloo",
    timeout_s: float = 60.0,
    prefix: str = "instance",
) -> dist.ProcessGroup:
    """Join (rank 0: host) the process group of one instance's ranks, without the default process group.
    Raises ValueError: an unknown backend or a rank outside [0, world_size); RuntimeError /
    DistStoreError: the rendezvous did not complete within `timeout_s`."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown process group backend {backend!r}; expected one of {BACKENDS}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside [0, world_size={world_size})")
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout)
    store = dist.PrefixStore(f"{prefix}/", store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, options)
    try:
        from torch_npu._C._distributed_c10d import ProcessGroupHCCL  # type: ignore[import-not-found]
    except ImportError as e:
        raise ValueError("backend 'hccl' needs torch_npu, which is not installed") from e
    options = ProcessGroupHCCL.Options()
    options._timeout = timeout
    return ProcessGroupHCCL(store, rank, world_size, options)
