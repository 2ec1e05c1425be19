"""The scheduling decision of one engine step, as a pure function over plain data.

No torch, no block manager, no request objects: the live `Scheduler` (pdcluster/engine/scheduler.py) and the
capacity planner's simulator build `RequestView`s and call the very same `schedule_step`.

Policy (vLLM v1's, plus "decode first"), one step under a token budget:
1. Running requests: decodes before prefill chunks, each group in arrival order. Each gets
   `min(num_tokens_to_compute, budget left)` tokens (prefill chunks also capped by
   `long_prefill_token_threshold`). When the free blocks cannot hold a request's new slots, the most
   recently arrived running request is preempted (recompute: it returns to waiting and frees its blocks),
   repeatedly, until they can; a request that is itself the most recent one preempts itself.
2. Waiting requests, first come first served and only in a step without preemption: admitted while
   `max_num_seqs`, the budget and the free blocks allow. Prefix-cache hits cost no budget. Without
   chunked prefill the remaining prompt must fit the budget whole; the first request that cannot be
   admitted stops admission (no overtaking), except that with several KV pools (`engine.kv_pools`) a
   request short of its own pool's blocks stops only its pool's later requests.

Block accounting is conservative: preempting a request counts only the blocks it holds alone, and a
prefix hit on a free cached block counts as taking a free block, so the plan is always applicable.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one engine step.

    Attributes:
        max_num_batched_tokens: token budget of one step (all requests together).
        max_num_seqs: most requests in the running batch.
        block_size: token slots per KV block.
        max_model_len: most tokens (prompt + output) of one request.
        enable_chunked_prefill: split prompts across steps; off, a prompt runs whole in one step, which
            needs `max_num_batched_tokens >= max_model_len`.
        long_prefill_token_threshold: most tokens of one prefill chunk per step (0 = no cap), so one long
            prompt cannot take the whole budget; needs chunked prefill.
        num_lookahead_tokens: slots to reserve past a sampling request's scheduled tokens, best effort
            (only from blocks the plan leaves free): chained MTP drafting writes MTP-layer KV there
            (k - 1 for k speculative tokens). Not counted by the policy, so it never causes preemption.
    """

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
    """What the policy knows of one request.

    Attributes:
        request_id: unique id.
        arrival_index: arrival order (smaller = earlier); ties are not allowed.
        num_computed_tokens: tokens whose KV is cached (0 for a waiting request).
        num_tokens_to_compute: `num_tokens + len(spec_token_ids) - num_computed_tokens`, >= 1
            (for a waiting request before any prefix-cache hit is subtracted).
        is_prefill: still computing its prompt (or recomputing after preemption), i.e.
            `num_computed_tokens < num_tokens - 1`; always True for a waiting request.
        num_blocks_held: blocks in its block table (running requests).
        num_blocks_exclusive: of those, blocks no other request holds: what preempting it frees.
        num_cached_tokens: prefix-cache hit of a waiting request (a multiple of block_size).
        num_cached_blocks_evictable: of the hit blocks, those in the free pool (claiming them uses up
            free blocks).
        pool: its KV block pool (`engine.kv_pools`); blocks are counted per pool.
    """

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
    """The decision for one step.

    Attributes:
        num_scheduled_tokens: request id -> tokens to compute this step, for running and admitted
            requests, in scheduling order (decodes, prefill chunks, admissions).
        num_new_blocks: request id -> fresh blocks to allocate (prefix-cache hits excluded).
        admitted: waiting request id -> its prefix-cache hit in tokens, in admission order.
        preempted_request_ids: running requests to preempt (recompute), in preemption order.
        num_free_blocks_left: free blocks left by the plan (by its conservative accounting).
    """

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
    """Raise ValueError when a request could never run to completion, even alone.

    A request needs at most `num_prompt_tokens + max_tokens - 1` KV slots (the last output token is
    never computed; draft tokens are capped to the output still allowed), and positions below
    `max_model_len`.
    """
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
    """Decide one step: tokens per request, admissions and preemptions (see the module docstring).

    Args:
        config: step limits.
        running: requests in the running batch (any order).
        waiting: queued requests, preempted ones included (any order).
        num_free_blocks: blocks no request holds, evictable cached blocks included; a sequence: per KV
            pool (`RequestView.pool` indexes it).

    Returns:
        The `StepPlan`; it never exceeds the budget, `max_num_seqs` or `num_free_blocks`.
    """
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
            blocked_pools.add(view.pool)  # first come first served within a pool; other pools go on
            continue
        admitted[view.request_id] = view.num_cached_tokens
        scheduled[view.request_id] = num_new
        new_blocks[view.request_id] = num_blocks
        budget -= num_new
        free[view.pool] -= num_blocks + view.num_cached_blocks_evictable
        num_seqs += 1

    return StepPlan(scheduled, new_blocks, admitted, tuple(preempted), sum(free))
