"""DeepSeekMoE routing reference: sigmoid scores, bias for selection only, group-limited top-k.

Source: DeepSeek-V3 report (arXiv 2412.19437) section 2.1.2, eqs. 12-16 and auxiliary-loss-free balancing;
a group's score is the sum of its two best expert scores, as in the public config's `n_group`/`topk_group`.
"""

from __future__ import annotations

import torch


def grouped_topk(
    router_logits: torch.Tensor,
    e_score_correction_bias: torch.Tensor | None,
    *,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's experts and gate weights.

    router_logits: [num_tokens, n_routed_experts] float32
    e_score_correction_bias: [n_routed_experts] float32, for selection only
    returns topk_weights: [num_tokens, top_k] float32, topk_ids: [num_tokens, top_k] int64
    """
    num_tokens, num_experts = router_logits.shape
    scores = router_logits.float().sigmoid()
    choice = scores if e_score_correction_bias is None else scores + e_score_correction_bias.float()
    if n_group > 1:
        # explicit group size: a batch of 0 tokens (an idle EP rank) must reshape too
        group_size = num_experts // n_group
        group_scores = choice.view(num_tokens, n_group, group_size).topk(2, dim=-1).values.sum(-1)  # [T, G]
        group_ids = group_scores.topk(topk_group, dim=-1).indices
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_ids, True)
        expert_mask = group_mask[:, :, None].expand(-1, -1, group_size).reshape(num_tokens, num_experts)
        choice = choice.masked_fill(~expert_mask, float("-inf"))
    topk_ids = choice.topk(top_k, dim=-1).indices
    topk_weights = scores.gather(1, topk_ids)
    if norm_topk_prob:
        topk_weights = topk_weights / (topk_weights.sum(-1, keepdim=True) + 1e-20)
    return topk_weights * routed_scaling_factor, topk_ids
