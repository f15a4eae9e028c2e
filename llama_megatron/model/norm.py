"""RMSNorm with HF's exact cast order."""

from __future__ import annotations

import torch
from torch import nn

from llama_megatron.parallel.collectives import all_reduce_grad_in_tp
from llama_megatron.parallel.context import ParallelContext
from llama_megatron.parallel.layers import mark_replicated


class RMSNorm(nn.Module):
    """``w * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(x.dtype)`` (HF multiplies after casting back).

    Under sequence parallelism each rank normalises a sequence shard, so the weight's gradient is summed over
    the TP group (see :func:`all_reduce_grad_in_tp`).
    """

    def __init__(self, hidden_size: int, eps: float, pctx: ParallelContext) -> None:
        super().__init__()
        self.eps = eps
        self.pctx = pctx
        self.weight = mark_replicated(nn.Parameter(torch.ones(hidden_size)))
        if pctx.sequence_parallel:
            self.weight.sequence_parallel = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        weight = all_reduce_grad_in_tp(self.weight, self.pctx) if self.pctx.sequence_parallel else self.weight
        return weight * h.to(dtype)
