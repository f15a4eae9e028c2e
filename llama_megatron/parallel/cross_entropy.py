"""Cross-entropy over vocab-sharded logits that never materialises the full vocabulary on one rank.

Three small all-reduces over TP (max, target logit, sum of exponentials) replace gathering [tokens, vocab]
logits. Columns past the true vocabulary (Megatron's padding) are masked to -inf so they get zero probability
and zero gradient.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from llama_megatron.parallel.context import ParallelContext

IGNORE_INDEX = -100  # label of a token that is not trained (HF's and PyTorch's convention)


def _all_reduce(x: torch.Tensor, op, pctx: ParallelContext) -> None:
    if pctx.tp_size > 1:
        dist.all_reduce(x, op=op, group=pctx.tp_group)


def _true_vocab_logits(logits: torch.Tensor, pctx: ParallelContext, vocab_size: int) -> torch.Tensor:
    """This rank's vocabulary shard of ``logits`` in fp32, the padding columns past the true vocabulary at -inf."""
    rows = logits.shape[-1]
    valid_cols = vocab_size - pctx.tp_rank * rows
    logits = logits.float()
    if valid_cols < rows:
        logits = logits.clone()
        logits[..., max(valid_cols, 0):] = float("-inf")
    return logits


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, pctx, vocab_size, ignore_index):
        rows = logits.shape[-1]
        input_dtype = logits.dtype
        vocab_start = pctx.tp_rank * rows
        logits = _true_vocab_logits(logits, pctx, vocab_size)

        logits_max = logits.amax(dim=-1)
        _all_reduce(logits_max, dist.ReduceOp.MAX, pctx)
        shifted = logits - logits_max.unsqueeze(-1)

        local_target = target - vocab_start
        not_here = (local_target < 0) | (local_target >= rows)
        local_target = local_target.masked_fill(not_here, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(not_here, 0.0)
        _all_reduce(target_logit, dist.ReduceOp.SUM, pctx)

        exp_logits = shifted.exp()
        sum_exp = exp_logits.sum(dim=-1)
        _all_reduce(sum_exp, dist.ReduceOp.SUM, pctx)

        ignored = target == ignore_index
        loss = (sum_exp.log() - target_logit).masked_fill(ignored, 0.0)

        exp_logits.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(exp_logits, local_target, not_here, ignored)
        ctx.logits_dtype = input_dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, not_here, ignored = ctx.saved_tensors
        grad = softmax
        hit = (~not_here).to(grad.dtype)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -hit.unsqueeze(-1))
        grad.mul_(grad_loss.masked_fill(ignored, 0.0).unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, pctx: ParallelContext,
                                 vocab_size: int, ignore_index: int = -100) -> torch.Tensor:
    """Per-token loss (fp32) for ``logits`` [..., padded_vocab / tp] and ``target`` [...]; 0 where ignored.

    The loss is computed in fp32 whatever the logits' dtype.
    """
    return _VocabParallelCrossEntropy.apply(logits, target, pctx, vocab_size, ignore_index)


@torch.no_grad()
def vocab_parallel_entropy(logits: torch.Tensor, pctx: ParallelContext, vocab_size: int) -> torch.Tensor:
    """The entropy (nats, fp32, no gradient: a metric, and what GRPO's high-entropy mask ranks) of each position's
    next-token distribution over the true vocabulary, from ``logits`` [..., padded_vocab / tp]: ``log S - sum(e z) /
    S`` with ``e = exp(z - max)``, ``S = sum(e)``; one max and one two-value sum over TP, no full vocabulary."""
    shifted = _true_vocab_logits(logits, pctx, vocab_size)
    top = shifted.amax(dim=-1)
    _all_reduce(top, dist.ReduceOp.MAX, pctx)
    shifted = shifted - top.unsqueeze(-1)
    weights = shifted.exp()
    sums = torch.stack([weights.sum(dim=-1), (weights * shifted.masked_fill(weights == 0, 0.0)).sum(dim=-1)])
    _all_reduce(sums, dist.ReduceOp.SUM, pctx)
    return sums[0].log() - sums[1] / sums[0]


def masked_mean_loss(per_token_loss: torch.Tensor, target: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Mean over tokens that count (HF's reduction); 0 rather than NaN when none does."""
    count = (target != ignore_index).sum().clamp(min=1)
    return per_token_loss.sum() / count
