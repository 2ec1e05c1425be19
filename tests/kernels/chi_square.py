"""Pearson chi-square goodness-of-fit p-value (no scipy: the chi-square survival function is
`Q(dof / 2, stat / 2)`, the regularized upper incomplete gamma function, `torch.special.gammaincc`)."""

from __future__ import annotations

import torch


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """P-value of observing `counts [V]` (int) under categorical `probs [V]`.

    Categories with probability 0 are left out (the caller asserts their counts are 0); degrees of
    freedom = (categories with probability > 0) - 1.
    """
    support = probs > 0
    expected = probs[support].double() * counts.sum().double()
    observed = counts[support].double()
    statistic = ((observed - expected) ** 2 / expected).sum()
    dof = int(support.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), statistic / 2))
