"""DeepSeek-V3's expert choice (transformers' ``DeepseekV3TopkRouter``): group-limited top-k over sigmoid scores with
the auxiliary-loss-free correction bias (:class:`~llama_megatron.model.moe.MoEMLP` with ``routing``
"sigmoid_group")."""

from __future__ import annotations

import torch


def choose_in_groups(logits: torch.Tensor, bias: torch.Tensor, n_group: int, topk_group: int, top_k: int,
                     normalise: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's ``top_k`` experts and their weights ([tokens, k] each) from its router ``logits``: sigmoid scores
    in fp32; with the correction ``bias`` added (for the choice only), each of ``n_group`` groups of experts is
    ranked by its two best scores, the best ``topk_group`` groups kept, and the k best of their experts chosen; their
    unbiased scores, renormalised where ``normalise`` (plus 1e-20), times ``scale``, are the weights."""
    scores = torch.sigmoid(logits.float())
    biased = scores + bias.float()
    experts = scores.shape[-1]
    per_group = experts // n_group
    group_scores = biased.view(-1, n_group, per_group).topk(2, dim=-1)[0].sum(dim=-1)
    groups = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    kept = torch.zeros_like(group_scores).scatter_(1, groups, 1).bool()
    kept = kept.unsqueeze(-1).expand(-1, n_group, per_group).reshape(-1, experts)
    chosen = torch.topk(biased.masked_fill(~kept, float("-inf")), k=top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, chosen)
    if normalise:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scale, chosen
