"""RMSNorm (optionally fused with the residual add before it); the arithmetic is the kernel seam's."""

from __future__ import annotations

import torch
from torch import nn

from llama_megatron.model.kernels import REFERENCE, Kernels
from llama_megatron.parallel.collectives import all_reduce_grad_in_tp
from llama_megatron.parallel.context import ParallelContext
from llama_megatron.parallel.layers import mark_replicated
from llama_megatron.parallel.weight_grad import WeightGradStore, defer_gradient


class RMSNorm(nn.Module):
    """``w * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(x.dtype)`` (HF multiplies after casting back).

    Under sequence parallelism each rank normalises a sequence shard, so the weight's gradient is summed over
    the TP group (see :func:`all_reduce_grad_in_tp`). ``partial_over_tp`` says so for other reasons: Qwen3's q/k
    norms weigh every head alike, and each TP rank holds a share of the heads.
    """

    def __init__(self, hidden_size: int, eps: float, pctx: ParallelContext, kernels: Kernels = REFERENCE,
                 partial_over_tp: bool | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.pctx = pctx
        self.kernels = kernels
        self.weight = mark_replicated(nn.Parameter(torch.ones(hidden_size)))
        self.partial_over_tp = pctx.sequence_parallel if partial_over_tp is None else (partial_over_tp and
                                                                                       pctx.tp_size > 1)
        if self.partial_over_tp:
            self.weight.sequence_parallel = True
        self.weight_grad_store: WeightGradStore | None = None  # set for a zero-bubble schedule (weight_grad.py)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """``norm(x)``; with ``residual``, the pair ``(residual + x, norm(residual + x))``."""
        weight = all_reduce_grad_in_tp(self.weight, self.pctx) if self.partial_over_tp else self.weight
        # a split backward computes the weight's gradient with the input's (one kernel) but accumulates it, and
        # under SP all-reduces it, in W
        weight = defer_gradient(weight, self.weight_grad_store)
        if residual is None:
            return self.kernels.rms_norm(x, weight, self.eps)
        return self.kernels.add_rms_norm(residual, x, weight, self.eps)


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama 4's weightless q/k norm (HF's ``Llama4TextL2Norm``): ``x * rsqrt(mean(x^2) + eps)`` over the last
    dimension, in fp32 and cast back."""
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
