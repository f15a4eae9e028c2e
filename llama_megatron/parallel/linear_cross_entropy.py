"""LM head + vocab-parallel cross-entropy in token chunks: the [tokens, vocab] logits never exist at once.

For each chunk of tokens the local logits are computed (in the weight's dtype, then fp32, as the reference loss
does), their softmax statistics reduced over TP (the max, then the sum of exponentials and the target logit in
one all-reduce), and the chunk's gradients with respect to the hidden states and the weight are computed at once,
while its logits are still in cache: the result is a sum whose gradient is fixed up to the scalar the caller's
reduction applies, so backward only scales the stored gradients. Neither the logits nor their softmax are kept
for backward and nothing is recomputed (Liger-Kernel's fused linear cross-entropy does the same at TP=1).

Padded vocabulary columns are masked to -inf as in :mod:`llama_megatron.parallel.cross_entropy`.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from llama_megatron.parallel.context import ParallelContext

MIN_CHUNK_TOKENS = 1024  # below this the head's matmuls re-read the weight too often per token


def default_chunk_tokens(tokens: int, local_vocab: int, hidden_size: int) -> int:
    """About as many logits per chunk as hidden-state elements (Liger's rule), at least MIN_CHUNK_TOKENS."""
    return max(MIN_CHUNK_TOKENS, math.ceil(tokens / math.ceil(local_vocab / hidden_size)))


_cpu_logits_workspace: dict[torch.dtype, torch.Tensor] = {}


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """fp32 logits of one chunk, vocabulary-major: ``weight @ hidden.T`` [local vocab, tokens], scratch that the
    next chunk overwrites.

    Vocabulary-major because that matmul is the faster of the two orientations (on CPU 80 vs 93 ms for
    512 tokens x 32k vocabulary; MKL packs the larger operand either way) and the weight-gradient matmul then
    needs no transpose. On CPU the logits are written into a buffer kept across calls: with no caching
    allocator a fresh chunk-sized tensor (64 MiB here) goes back to the OS when freed and its pages fault in
    again on every step. CUDA's caching allocator already reuses the block.
    """
    shape = (weight.shape[0], hidden.shape[0])
    if hidden.device.type != "cpu":
        return torch.mm(weight, hidden.t()).float()
    buffer = _cpu_logits_workspace.get(weight.dtype)
    if buffer is None or buffer.numel() < shape[0] * shape[1]:
        buffer = _cpu_logits_workspace[weight.dtype] = torch.empty(shape[0] * shape[1], dtype=weight.dtype)
    return torch.mm(weight, hidden.t(), out=buffer[:shape[0] * shape[1]].view(shape)).float()


class _LinearCrossEntropySum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, target, pctx, vocab_size, ignore_index, chunk_tokens):
        rows = weight.shape[0]
        vocab_start = pctx.tp_rank * rows
        valid_rows = vocab_size - vocab_start
        want_hidden_grad, want_weight_grad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if want_hidden_grad else None
        grad_weight = None  # fp32, made by the first chunk's matmul (zeros + an accumulating one is slower)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk_tokens):
            h = hidden[start:start + chunk_tokens]
            t = target[start:start + chunk_tokens]
            logits = _chunk_logits(h, weight)  # [rows, tokens]: reductions below run over dim 0
            if valid_rows < rows:
                logits[max(valid_rows, 0):] = float("-inf")
            logits_max = logits.amax(dim=0)
            if pctx.tp_size > 1:
                dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=pctx.tp_group)
            logits.sub_(logits_max)
            local_t = t - vocab_start
            not_here = (local_t < 0) | (local_t >= rows)
            local_t = local_t.masked_fill(not_here, 0).unsqueeze(0)
            target_logit = logits.gather(0, local_t).squeeze(0).masked_fill(not_here, 0.0)
            logits.exp_()
            stats = torch.stack([logits.sum(dim=0), target_logit])
            if pctx.tp_size > 1:
                dist.all_reduce(stats, group=pctx.tp_group)
            sum_exp, target_logit = stats[0], stats[1]
            ignored = t == ignore_index
            total += (sum_exp.log() - target_logit).masked_fill(ignored, 0.0).sum()
            if grad_hidden is None and not want_weight_grad:
                continue
            # d(loss)/d(logits): the softmax (zero for ignored tokens, in the same pass), minus one at the target
            logits.mul_(sum_exp.reciprocal().masked_fill(ignored, 0.0))
            at_target = ~(not_here | ignored)
            logits.scatter_add_(0, local_t, -at_target.to(logits.dtype).unsqueeze(0))
            grad_logits = logits.to(weight.dtype)
            if grad_hidden is not None:
                torch.mm(grad_logits.t(), weight, out=grad_hidden[start:start + chunk_tokens])
            if want_weight_grad:
                chunk_grad = grad_logits @ h
                if grad_weight is None:
                    grad_weight = chunk_grad.float()
                else:
                    grad_weight += chunk_grad
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        ctx.backward_done = False
        return total

    @staticmethod
    def backward(ctx, grad_total):
        # The stored gradients are scaled in place: they are this function's own and an out-of-place product
        # would be a second weight-sized tensor (on CPU, ~15 ms of fresh pages per step for a 32k vocabulary).
        # So the graph can be run backward once only, which is what training does.
        if ctx.backward_done:
            raise RuntimeError("linear_cross_entropy_sum: backward can run once (its gradients are scaled in place)")
        ctx.backward_done = True
        grad_hidden, grad_weight = ctx.saved_tensors
        if grad_hidden is not None:
            grad_hidden = grad_hidden.mul_(grad_total.to(grad_hidden.dtype))
        if grad_weight is not None:
            grad_weight = grad_weight.mul_(grad_total).to(ctx.weight_dtype)
        return grad_hidden, grad_weight, None, None, None, None, None


def linear_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                             pctx: ParallelContext, vocab_size: int, ignore_index: int = -100,
                             chunk_tokens: int | None = None) -> torch.Tensor:
    """Sum over tokens (fp32 scalar) of the cross-entropy of ``hidden @ weight.T`` against ``target``.

    ``hidden`` [..., H] is this rank's input to the vocab-parallel head (after the TP copy or SP gather),
    ``weight`` [padded_vocab / tp, H] its shard, ``target`` [...] full-vocabulary ids (``ignore_index`` = not
    trained). The caller divides by its token count, as the reference loss does.
    """
    hidden = hidden.reshape(-1, hidden.shape[-1])
    target = target.reshape(-1)
    if chunk_tokens is None:
        chunk_tokens = default_chunk_tokens(hidden.shape[0], weight.shape[0], weight.shape[1])
    return _LinearCrossEntropySum.apply(hidden, weight, target, pctx, vocab_size, ignore_index, chunk_tokens)
