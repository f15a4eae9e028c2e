"""Autograd-aware tensor-parallel collectives (Megatron's mappings).

Each function is a pair (forward op, backward op) over the TP group of a :class:`ParallelContext`:

=========================  =========================  =========================
function                   forward                    backward
=========================  =========================  =========================
copy_to_tp_region          identity                   all-reduce
reduce_from_tp_region      all-reduce                 identity
scatter_to_tp_region       keep own last-dim chunk    all-gather last dim
gather_from_tp_region      all-gather last dim        keep own chunk
scatter_to_sequence        keep own seq chunk         all-gather seq
gather_from_sequence       all-gather seq             reduce-scatter seq
reduce_scatter_to_sequence reduce-scatter seq         all-gather seq
=========================  =========================  =========================

Outside the TP group: :func:`all_to_all_tokens` (expert parallelism's token exchange, uneven splits; its
backward is the exchange back) and :func:`scale_gradient` (identity forward, gradient times a factor).

The sequence dimension is dim 1 (tensors are [batch, seq, ...]). With a TP size of 1 every op is the identity,
so the model runs without torch.distributed.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from llama_megatron.parallel.context import ParallelContext

SEQ_DIM = 1

# torch 2.13 renamed the tensor collectives (*_single); older releases only have *_tensor.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous()
    dist.all_reduce(x, group=group)
    return x


# The collectives run on dim 0 and return the result in the caller's [batch, seq, ...] order as a contiguous
# tensor. A strided view would flow through the residual adds into the pipeline stage's output, and DeepSpeed's
# p2p send between stages refuses non-contiguous tensors (F.linear would copy it anyway).
def _all_gather(x: torch.Tensor, dim: int, size: int, group) -> torch.Tensor:
    x = x.movedim(dim, 0).contiguous()
    out = torch.empty((size * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_single(out, x, group=group)
    return out.movedim(0, dim).contiguous()


def _reduce_scatter(x: torch.Tensor, dim: int, size: int, group) -> torch.Tensor:
    if x.shape[dim] % size:
        raise ValueError(f"dimension {dim} of size {x.shape[dim]} is not divisible by TP size {size}")
    x = x.movedim(dim, 0).contiguous()
    out = torch.empty((x.shape[0] // size,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    _reduce_scatter_single(out, x, group=group)
    return out.movedim(0, dim).contiguous()


def _split(x: torch.Tensor, dim: int, size: int, rank: int) -> torch.Tensor:
    if x.shape[dim] % size:
        raise ValueError(f"dimension {dim} of size {x.shape[dim]} is not divisible by TP size {size}")
    return x.chunk(size, dim=dim)[rank].contiguous()


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, pctx):
        ctx.pctx = pctx
        # no gradient arrives when a weight's gradient is deferred to a W pass (weight_grad.py): nothing to reduce
        ctx.set_materialize_grads(False)
        return x

    @staticmethod
    def backward(ctx, grad):
        if grad is None:
            return None, None
        return _all_reduce(grad, ctx.pctx.tp_group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, pctx):
        return _all_reduce(x.clone(), pctx.tp_group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, pctx, dim):
        ctx.pctx, ctx.dim = pctx, dim
        return _split(x, dim, pctx.tp_size, pctx.tp_rank)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.dim, ctx.pctx.tp_size, ctx.pctx.tp_group), None, None


class _GatherFromRegion(torch.autograd.Function):
    """All-gather; the backward keeps this rank's chunk (the consumer is replicated across TP)."""

    @staticmethod
    def forward(ctx, x, pctx, dim):
        ctx.pctx, ctx.dim = pctx, dim
        return _all_gather(x, dim, pctx.tp_size, pctx.tp_group)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, ctx.dim, ctx.pctx.tp_size, ctx.pctx.tp_rank), None, None


class _GatherSequence(torch.autograd.Function):
    """All-gather on the sequence; the backward reduce-scatters, since each rank's consumer is a TP shard."""

    @staticmethod
    def forward(ctx, x, pctx):
        ctx.pctx = pctx
        return _all_gather(x, SEQ_DIM, pctx.tp_size, pctx.tp_group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, SEQ_DIM, ctx.pctx.tp_size, ctx.pctx.tp_group), None


class _ReduceScatterSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, pctx):
        ctx.pctx = pctx
        return _reduce_scatter(x, SEQ_DIM, pctx.tp_size, pctx.tp_group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, SEQ_DIM, ctx.pctx.tp_size, ctx.pctx.tp_group), None


def copy_to_tp_region(x: torch.Tensor, pctx: ParallelContext) -> torch.Tensor:
    return x if pctx.tp_size == 1 else _CopyToRegion.apply(x, pctx)


def reduce_from_tp_region(x: torch.Tensor, pctx: ParallelContext) -> torch.Tensor:
    return x if pctx.tp_size == 1 else _ReduceFromRegion.apply(x, pctx)


def scatter_to_tp_region(x: torch.Tensor, pctx: ParallelContext, dim: int = -1) -> torch.Tensor:
    return x if pctx.tp_size == 1 else _ScatterToRegion.apply(x, pctx, dim % x.dim())


def gather_from_tp_region(x: torch.Tensor, pctx: ParallelContext, dim: int = -1) -> torch.Tensor:
    return x if pctx.tp_size == 1 else _GatherFromRegion.apply(x, pctx, dim % x.dim())


def scatter_to_sequence_region(x: torch.Tensor, pctx: ParallelContext) -> torch.Tensor:
    """Keep this rank's sequence chunk; the backward all-gathers (Megatron's scatter_to_sequence_parallel)."""
    return x if pctx.tp_size == 1 else _ScatterToRegion.apply(x, pctx, SEQ_DIM)


def gather_from_sequence_region(x: torch.Tensor, pctx: ParallelContext) -> torch.Tensor:
    return x if pctx.tp_size == 1 else _GatherSequence.apply(x, pctx)


def reduce_scatter_to_sequence_region(x: torch.Tensor, pctx: ParallelContext) -> torch.Tensor:
    return x if pctx.tp_size == 1 else _ReduceScatterSequence.apply(x, pctx)


def all_reduce_grad_in_tp(param: torch.Tensor, pctx: ParallelContext) -> torch.Tensor:
    """Use ``param`` in a sequence-parallel region: its gradient is summed over the TP group.

    Norm weights under sequence parallelism see only a sequence shard per rank; routing the weight through
    this op makes autograd produce the full gradient on every rank, with no hooks to forget.
    """
    return copy_to_tp_region(param, pctx)


class _AllToAllTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.splits, ctx.group = (input_splits, output_splits), group
        out = x.new_empty((sum(output_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        input_splits, output_splits = ctx.splits
        out = grad.new_empty((sum(input_splits), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), input_splits, output_splits, group=ctx.group)
        return out, None, None, None


def all_to_all_tokens(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
    """Rows of ``x`` exchanged over ``group``: ``input_splits[r]`` consecutive rows go to rank r, and
    ``output_splits[r]`` rows arrive from it, in rank order. Gradients travel back the same way."""
    return _AllToAllTokens.apply(x, output_splits, input_splits, group)


class _ScaleGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


def scale_gradient(x: torch.Tensor, factor: float) -> torch.Tensor:
    """``x`` itself, whose gradient is multiplied by ``factor`` on the way back."""
    return x if factor == 1 else _ScaleGradient.apply(x, factor)
