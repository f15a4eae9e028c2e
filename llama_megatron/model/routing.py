"""DeepSeek-V3's expert choice (transformers' ``DeepseekV3TopkRouter``): group-limited top-k over sigmoid scores with
the correction bias (:class:`~llama_megatron.model.moe.MoEMLP` with ``routing`` "sigmoid_group"), and the bias's
auxiliary-loss-free update between optimizer steps (the DeepSeek-V3 report, section 2.1.2).

Each layer's bias moves by ``rate x sign(mean load - load)``: an expert chosen more often than the mean becomes less
likely to be chosen, one chosen less more likely; the scores that weight the chosen experts' outputs stay unbiased.
The loads are the step's assignments (before any capacity drops some) summed over the data-parallel and context-
parallel ranks, which route different tokens (TP ranks route the same ones; EP ranks are data-parallel ranks), so
every rank makes the same update and a layout's biases are the one-process run's.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn


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


def _gathered(param: torch.Tensor):
    """The whole parameter inside the block, and under ZeRO-3 the same update on each rank partitioned again."""
    if not hasattr(param, "ds_id"):
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters([param], modifier_rank=0)


@torch.no_grad()
def update_routing_biases(model: nn.Module, pctx, rate: float) -> int:
    """After an optimizer step: every grouped-routing MoE layer of ``model`` (this pipeline stage's) moves its
    correction bias by ``rate x sign(mean load - load)``, its loads the step's assignments summed over the DP x CP
    group (one all-reduce of every layer's counts), which it then clears. Returns the number of layers updated."""
    layers = [m for m in model.modules() if getattr(m, "grouped_routing", False)]
    if not layers:
        return 0
    counts = torch.stack([m.step_counts for m in layers])
    if pctx.dp_cp_size > 1:
        dist.all_reduce(counts, group=pctx.dp_cp_group)
    loads = counts.double()
    moves = rate * torch.sign(loads.mean(dim=-1, keepdim=True) - loads)
    for layer, move in zip(layers, moves):
        bias = layer.router.e_score_correction_bias
        with _gathered(bias):
            bias.add_(move.to(bias.dtype))
        layer.step_counts.zero_()
    return len(layers)


def keep_routing_biases_fp32(model: nn.Module) -> None:
    """The routing biases back in fp32 after DeepSpeed cast the model to bf16 or fp16 (transformers keeps
    ``e_score_correction_bias`` in fp32 too): an update of 1e-3 would vanish in a bf16 bias near 1. They are frozen,
    outside every optimizer group; under ZeRO-3 they stay in the dtype of its partitions."""
    for module in model.modules():
        bias = getattr(module, "e_score_correction_bias", None)
        if bias is not None and not hasattr(bias, "ds_id") and bias.dtype != torch.float32:
            bias.data = bias.data.float()
