"""Adaptive speculation: how many MTP drafts k to propose next step, from recent acceptance counts.

Pure functions over plain lists; the executor keeps the counters and applies the choice
(`EngineConfig.adaptive_speculation`).

The rule (maximize expected tokens minus verification cost). Let `r_j` be the probability that the draft
at depth j (1 = first draft after the verified token) is reached *and* accepted: with per-depth conditional
acceptance `a_i`, `r_j = prod_{i<=j} a_i`. A step with k drafts commits `E(k) = 1 + sum_{j<=k} r_j` tokens
in expectation, and verifies (and drafts) k more tokens than a step without drafts. Charging each extra
draft `min_accept_prob` tokens' worth of work (`c`: the step cost of one more draft, verified, relative to
the value of one committed token), the net gain is `E(k) - c * k`, whose increment for draft j is
`r_j - c`. Since `r_j` never increases with depth, the gain is concave in k and its maximum is at

    k* = the number of leading depths j with r_j >= c,   clamped to [1, max_k].

(The plain ratio "accepted per verified token", `E(k) / (k + 1)`, is no use: it is largest at k = 0 for
any acceptance < 1.) k never drops below 1: one draft keeps measuring acceptance, and k = 0 would stop it.

Estimates. `Request.num_accepted_tokens_per_position[j-1] / num_draft_tokens_per_position[j-1]` counts
acceptance at depth j only when depths < j were accepted, so their ratio estimates `r_j` directly. The
counters are exponentially decayed (`decay_counts`), so the ratio follows recent traffic. A depth whose
decayed draft count is below `min_num_drafts` is unmeasured (never drafted since k shrank, or stale): its
`r_j` is extrapolated as `r_{j-1} * a_m`, with `a_m` the conditional acceptance at the deepest measured
depth m (1 when nothing is measured). Stale depths are thereby re-explored once their counts decay away,
and an engine with no counts yet starts at `max_k`.
"""

from __future__ import annotations

from collections.abc import Sequence

DEFAULT_DECAY = 0.9
"""Per-step weight of older counts: a step's verification results count half after ~6.6 steps."""


def decay_counts(counts: Sequence[float], new_counts: Sequence[float], decay: float) -> list[float]:
    """`decay * counts + new_counts`, element-wise; the shorter list is padded with zeros.

    Args:
        counts: `[num_positions]` decayed counts so far (per draft depth).
        new_counts: `[num_positions']` this step's counts.
        decay: weight of the old counts, in [0, 1].

    Returns:
        `[max(num_positions, num_positions')]` the new decayed counts.
    """
    if not 0 <= decay <= 1:
        raise ValueError(f"decay must be in [0, 1], got {decay}")
    n = max(len(counts), len(new_counts))
    old = list(counts) + [0.0] * (n - len(counts))
    new = list(new_counts) + [0.0] * (n - len(new_counts))
    return [decay * o + x for o, x in zip(old, new, strict=True)]


def choose_num_speculative_tokens(
    accepted_per_position: Sequence[float],
    drafted_per_position: Sequence[float],
    max_k: int,
    min_accept_prob: float,
    min_num_drafts: float = 1.0,
) -> int:
    """The number of drafts k in [1, max_k] that maximizes expected committed tokens minus the cost of
    verifying the drafts (see the module docstring for the rule).

    Args:
        accepted_per_position: `[num_positions]` (decayed) drafts accepted at depth i+1; a draft counts
            as accepted only when every shallower draft of its step was accepted too.
        drafted_per_position: `[num_positions]` (decayed) drafts proposed at depth i+1.
        max_k: the configured `num_speculative_tokens`, >= 1.
        min_accept_prob: c, the probability of reaching and accepting a draft below which it does not pay
            for its verification; in (0, 1].
        min_num_drafts: a depth with fewer (decayed) drafts than this is unmeasured and extrapolated.

    Returns:
        k: the number of leading depths j <= max_k whose (estimated) `r_j >= min_accept_prob`, at least 1.

    Raises:
        ValueError: `max_k < 1`, `min_accept_prob` outside (0, 1], or lists of different lengths.
    """
    if max_k < 1:
        raise ValueError(f"max_k must be >= 1, got {max_k}")
    if not 0 < min_accept_prob <= 1:
        raise ValueError(f"min_accept_prob must be in (0, 1], got {min_accept_prob}")
    if len(accepted_per_position) != len(drafted_per_position):
        raise ValueError(
            f"{len(accepted_per_position)} accepted counts for {len(drafted_per_position)} drafted counts"
        )
    k = 0
    reach = 1.0  # r_{j-1}; r_0 = 1 (the verified token's own position is always reached)
    conditional = 1.0  # a_m at the deepest measured depth so far
    measuring = True
    for depth in range(max_k):
        drafted = drafted_per_position[depth] if depth < len(drafted_per_position) else 0.0
        measuring = measuring and drafted >= min_num_drafts
        if measuring:
            # min(): noise (or budget-capped deeper drafts) must not make a deeper depth likelier.
            r = min(reach, accepted_per_position[depth] / drafted)
            conditional = r / reach if reach > 0 else 0.0
        else:
            r = reach * conditional
        if r < min_accept_prob:
            break
        k, reach = depth + 1, r
    return max(1, k)
