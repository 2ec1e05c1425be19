"""Expert-parallel instances: the parallel settings, and the instance's own process group.

An instance of N ranks (`ParallelConfig.expert_parallel_size = data_parallel_size = N`) runs attention
data-parallel (each rank its own requests and paged KV cache) and routed experts split over the N ranks
(`models.ep_dispatch`). Its ranks share one torch.distributed process group made by `make_instance_group`
*without* the default process group (Ray actors already use that one for the KV transfer's
torch.distributed transport): a `TCPStore` hosted by rank 0, under a `PrefixStore` naming the instance,
and the backend's `ProcessGroup` class built on it directly (`torch.distributed.new_group` needs an
initialized default group, so it cannot be used here).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch.distributed as dist

BACKENDS = ("gloo", "nccl", "hccl")


@dataclass(frozen=True)
class ParallelConfig:
    """Parallel layout of one instance, as seen by one of its ranks (picklable; one per rank actor).

    Attributes:
        expert_parallel_size: EP ranks of the instance (1: no expert parallelism).
        rank: this rank, 0 .. expert_parallel_size - 1.
        data_parallel_size: attention replicas; must equal expert_parallel_size (DP attention, tensor
            parallelism 1). None means expert_parallel_size.
        num_redundant_experts: extra physical replicas of routed experts per MoE layer (EPLB places
            them); `n_routed_experts + num_redundant_experts` must be a multiple of expert_parallel_size.
        eplb_interval_steps: rebalance the experts every that many stepped engine steps; None: never (the
            default placement stays: logical experts in contiguous blocks, redundant ones round-robin).
        eplb_window_steps: engine steps of expert load the rebalance looks at (a sliding window).
        eplb_num_nodes: server nodes of the instance, for EPLB's hierarchical mode (1 here).
        collective_timeout_s: the most any collective of the instance's group waits, seconds; a dead or
            stopped rank fails every other rank's step within it. The first step's agreement also waits
            for the slowest rank to finish loading, so leave room for that.
        enable_micro_batch_overlap: split each MoE layer's tokens in two micro-batches whose all-to-alls
            overlap the other's expert compute (`models.ep_dispatch.EPDispatcher.forward`); same outputs.
    """

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

    Args:
        host, port: where rank 0 listens with its `TCPStore` (the others connect there).
        rank, world_size: this rank within the instance, and the instance's ranks.
        backend: `gloo` (CPU), `nccl` (CUDA) or `hccl` (Ascend NPU; needs `torch_npu`).
        timeout_s: store rendezvous timeout and the timeout of every collective on the group, seconds.
        prefix: store key prefix (distinct per instance when instances share a store host and port).

    Returns:
        The `ProcessGroup`; call its methods directly (`allreduce`, `allgather`, `alltoall_base`, ...) or
        pass it as `group=` to `torch.distributed` functions that accept an unregistered group.

    Raises:
        ValueError: an unknown backend or a rank outside [0, world_size).
        RuntimeError / DistStoreError: the rendezvous did not complete within `timeout_s`.
    """
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
