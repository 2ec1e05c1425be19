"""The scheduling decision of one engine step, as a pure function over plain data."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple


class SchedulerStats(NamedTuple):
    """A snapshot for metrics."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_preemptions: int
    prefix_cache_hit_rate: float | None
    num_prefix_cache_hit_tokens: int = 0


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one engine step."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    block_size: int = 16
    max_model_len: int = 4096
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    num_lookahead_tokens: int = 0

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "block_size", "max_model_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.num_lookahead_tokens < 0:
            raise ValueError(f"num_lookahead_tokens must be >= 0, got {self.num_lookahead_tokens}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(
                f"long_prefill_token_threshold must be >= 0, got {self.long_prefill_token_threshold}"
            )
        if not self.enable_chunked_prefill:
            if self.max_num_batched_tokens < self.max_model_len:
                raise ValueError(
                    f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_model_len "
                    f"({self.max_model_len}) when enable_chunked_prefill is false"
                )
            if self.long_prefill_token_threshold:
                raise ValueError("long_prefill_token_threshold needs enable_chunked_prefill")


class RequestView(NamedTuple):
    """What the policy knows of one request."""

    request_id: str
    arrival_index: int
    num_computed_tokens: int
    num_tokens_to_compute: int
    is_prefill: bool = True
    num_blocks_held: int = 0
    num_blocks_exclusive: int = 0
    num_cached_tokens: int = 0
    num_cached_blocks_evictable: int = 0
    pool: int = 0


@dataclass(frozen=True)
class StepPlan:
    """The decision for one step."""

    num_scheduled_tokens: dict[str, int]
    num_new_blocks: dict[str, int]
    admitted: dict[str, int]
    preempted_request_ids: tuple[str, ...]
    num_free_blocks_left: int

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def check_request_fits(
    config: SchedulerConfig, num_blocks: int, num_prompt_tokens: int, max_tokens: int
) -> None:
    """Raise ValueError when a request could never run to completion, even alone."""
    if num_prompt_tokens < 1:
        raise ValueError(f"the prompt must have at least 1 token, got {num_prompt_tokens}")
    num_tokens = num_prompt_tokens + max_tokens
    if num_tokens > config.max_model_len:
        raise ValueError(
            f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = {num_tokens} exceeds "
            f"max_model_len ({config.max_model_len})"
        )
    num_blocks_needed = cdiv(num_tokens - 1, config.block_size)
    if num_blocks_needed > num_blocks:
        raise ValueError(
            f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) needs {num_blocks_needed} "
            f"KV blocks of {config.block_size} tokens, but the whole cache has {num_blocks}"
        )


def _chunk_size(config: SchedulerConfig, num_tokens: int, is_prefill: bool, budget: int) -> int:
    if is_prefill and config.long_prefill_token_threshold:
        num_tokens = min(num_tokens, config.long_prefill_token_threshold)
    return min(num_tokens, budget)


def schedule_step(
    config: SchedulerConfig,
    running: Sequence[RequestView],
    waiting: Sequence[RequestView],
    num_free_blocks: int | Sequence[int],
) -> StepPlan:
    """Decide one step: tokens per request, admissions and preemptions (see the module docstring)."""
    bs = config.block_size
    budget = config.max_num_batched_tokens
    free = [num_free_blocks] if isinstance(num_free_blocks, int) else list(num_free_blocks)
    scheduled: dict[str, int] = {}
    new_blocks: dict[str, int] = {}
    preempted: list[str] = []
    # Preemption victims: the last element arrived most recently.
    alive = sorted(running, key=lambda v: v.arrival_index)

    for view in sorted(running, key=lambda v: (v.is_prefill, v.arrival_index)):
        if budget == 0:
            break
        if view.request_id in preempted:
            continue
        num_new = _chunk_size(config, view.num_tokens_to_compute, view.is_prefill, budget)
        num_blocks = max(0, cdiv(view.num_computed_tokens + num_new, bs) - view.num_blocks_held)
        while num_blocks > free[view.pool]:
            victim = alive.pop()
            preempted.append(victim.request_id)
            budget += scheduled.pop(victim.request_id, 0)
            free[victim.pool] += new_blocks.pop(victim.request_id, 0) + victim.num_blocks_exclusive
            if victim.request_id == view.request_id:
                break
        if view.request_id in preempted:
            continue
        scheduled[view.request_id] = num_new
        new_blocks[view.request_id] = num_blocks
        budget -= num_new
        free[view.pool] -= num_blocks

    admitted: dict[str, int] = {}
    num_seqs = len(running) - len(preempted)
    blocked_pools: set[int] = set()
    for view in [] if preempted else sorted(waiting, key=lambda v: v.arrival_index):
        if num_seqs >= config.max_num_seqs or budget == 0:
            break
        if view.pool in blocked_pools:
            continue
        num_uncached = view.num_tokens_to_compute - view.num_cached_tokens
        num_new = _chunk_size(config, num_uncached, True, budget)
        if num_new < num_uncached and not config.enable_chunked_prefill:
            break
        num_cached_blocks = view.num_cached_tokens // bs
        num_blocks = cdiv(view.num_computed_tokens + view.num_cached_tokens + num_new, bs) - num_cached_blocks
        if num_blocks + view.num_cached_blocks_evictable > free[view.pool]:
            blocked_pools.add(view.pool)
            continue
        admitted[view.request_id] = view.num_cached_tokens
        scheduled[view.request_id] = num_new
        new_blocks[view.request_id] = num_blocks
        budget -= num_new
        free[view.pool] -= num_blocks + view.num_cached_blocks_evictable
        num_seqs += 1

    return StepPlan(scheduled, new_blocks, admitted, tuple(preempted), sum(free))
