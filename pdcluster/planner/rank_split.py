"""How one step's work splits over an instance's data-parallel attention ranks (`planner.perf_model`)."""

from __future__ import annotations

import heapq

from pdcluster.planner.step_model import DecodeRow, PrefillChunk


def attention_sums(items, crossover_queries: int) -> list[float]:
    """`[expanded q, keys, pairs, absorbed q, keys, pairs]` over `(num_queries, context_len)` items."""
    acc = [0.0] * 6
    for n, ctx in items:
        base = 0 if n >= crossover_queries else 3
        acc[base] += n
        acc[base + 1] += ctx + n
        acc[base + 2] += n * ctx + n * (n + 1) / 2
    return acc


def decode_sums(rows: tuple[DecodeRow, ...], crossover_queries: int) -> tuple[list[float], int]:
    """`attention_sums` of decode rows and their query tokens, in one pass when every row verifies alike."""
    if not rows:
        return [0.0] * 6, 0
    q = rows[0].num_query_tokens
    if any(r.num_query_tokens != q for r in rows):
        acc = attention_sums(((r.num_query_tokens, r.context_len) for r in rows), crossover_queries)
        return acc, sum(r.num_query_tokens for r in rows)
    n, ctx_sum = len(rows), sum(r.context_len for r in rows)
    base = 0 if q >= crossover_queries else 3
    acc = [0.0] * 6
    acc[base] = float(n * q)
    acc[base + 1] = float(ctx_sum + n * q)
    acc[base + 2] = q * ctx_sum + n * q * (q + 1) / 2
    return acc, n * q


def slowest_rank_chunks(chunks: tuple[PrefillChunk, ...], dp: int) -> list[PrefillChunk]:
    """The most loaded DP rank's chunks when chunks go largest first to the least loaded rank (LPT)."""
    if dp == 1 or len(chunks) <= 1:
        return list(chunks)
    ranks = [(0, i, []) for i in range(min(dp, len(chunks)))]
    heapq.heapify(ranks)
    for c in sorted(chunks, key=lambda c: c.num_tokens, reverse=True):
        load, i, members = heapq.heappop(ranks)
        members.append(c)
        heapq.heappush(ranks, (load + c.num_tokens, i, members))
    return max(ranks)[2]
