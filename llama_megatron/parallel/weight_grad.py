"""Weight gradients split from input gradients, the split zero-bubble pipeline schedules are built on (Qi et al.,
"Zero Bubble Pipeline Parallelism"): B computes only what the previous stage waits for, the gradient of the
stage's input; W computes the weight gradients later, where the pipeline would otherwise idle.

A :class:`WeightGradStore` is attached in one place (:func:`attach_weight_grad_store`) to every module with a
``weight_grad_store`` attribute: the tensor-parallel linears (the LM head among them), LoRA adapters, the
vocab-parallel embedding for the tied head's product, and the norms, whose kernels compute the weight's gradient
with the input's (:func:`defer_gradient` moves its accumulation, and under SP its TP all-reduce, to W). Left in B:
the embedding lookup's gradient (the first stage sends nothing back, so nothing waits on its B) and the fused
loss's head weight, whose gradient that loss computes in its forward pass so as never to hold the logits.

Inside :meth:`WeightGradStore.input_gradients_only` a backward pass queues each linear's weight-gradient work (its
input and the gradient of its output) as one group instead of computing it; :meth:`WeightGradStore.run` computes
a group and accumulates it through each parameter's own
autograd accumulation, so gradient hooks (DeepSpeed's ZeRO and bf16 bookkeeping) see it as they see any backward.
A schedule runs each chunk's groups in the order their backward passes ran, so each parameter's gradient sums its
micro batches in the same order as without the split. W runs outside autograd's backward, so each queued work keeps the
metadata of the autograd node whose backward queued it, and :func:`deferred_origin` gives it while the work runs: the
profile's call graph attributes a W pass's products to the linear they belong to through it.

Outside that context the linears' backward computes everything at once, with the same matrix products autograd
uses for ``F.linear`` (``grad @ W`` for the input, ``grad^T @ x`` for the weight, the sum over rows for the bias):
the gradients are bit for bit those of the unsplit model, and a split backward's (B then W) are too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from llama_megatron.parallel.float8 import Float8Linear, float8_linear

# queued work: (weight, the computation of its gradient, the tensors that computation keeps alive, the metadata of the
# autograd node whose backward queued it)
_Deferred = tuple[nn.Parameter, Callable[[], torch.Tensor], tuple[torch.Tensor, ...], dict | None]
_running: list[dict | None] = []  # the origin of the queued work W computes now (innermost last)


def _current_node_metadata() -> dict | None:
    """The ``metadata`` dict of the autograd node running (None outside a backward): the node's own, which its
    observers (the call graph tags nodes with their module there) share, kept without keeping the node and the
    graph behind it alive until W."""
    node = torch._C._current_autograd_node()
    return None if node is None else node.metadata


def deferred_origin() -> dict | None:
    """While :meth:`WeightGradStore.run` computes queued weight-gradient work: the ``metadata`` of the autograd node
    whose backward queued it (else None). W runs outside autograd's backward, where
    ``torch._C._current_autograd_node()`` is None: an observer (the profile's call graph) reads the work's origin
    here."""
    return _running[-1] if _running else None


class WeightGradStore:
    """The queued weight-gradient work of the backward passes run with :meth:`input_gradients_only`, one group per
    backward pass, under a key (a pipeline chunk's micro batch) or in order."""

    def __init__(self) -> None:
        self._groups: dict[object, list[_Deferred]] = {}  # in the order the backward passes ran
        self._open: list[_Deferred] | None = None
        self._count = 0

    @contextlib.contextmanager
    def input_gradients_only(self, key: object = None) -> Iterator[None]:
        """B: backward passes inside compute input gradients; their weight-gradient work becomes one group, under
        ``key`` (default: a number of its own)."""
        if self._open is not None:
            raise RuntimeError("input_gradients_only is not reentrant")
        if key is None:
            key, self._count = ("pass", self._count), self._count + 1
        if key in self._groups:
            raise RuntimeError(f"weight-gradient work of {key!r} is queued already")
        self._open = []
        try:
            yield
        finally:
            self._groups[key] = self._open
            self._open = None

    def defer(self, weight: nn.Parameter, compute: Callable[[], torch.Tensor],
              keeps: tuple[torch.Tensor, ...] = ()) -> bool:
        """Queue ``compute`` (the weight's gradient; it holds the tensors ``keeps``) in the open group; False
        outside :meth:`input_gradients_only`."""
        if self._open is None:
            return False
        self._open.append((weight, compute, keeps, _current_node_metadata()))
        return True

    def pending_tensors(self) -> list[torch.Tensor]:
        """The tensors the queued work keeps alive (its memory: ``ActivationMeter``)."""
        return [t for group in self._groups.values() for _, _, keeps, _ in group for t in keeps]

    @property
    def pending(self) -> int:
        return len(self._groups)

    def run_oldest(self) -> None:
        """W: the oldest group's weight gradients."""
        self.run(next(iter(self._groups)))

    def run(self, key: object) -> None:
        """W: the weight gradients of the group queued under ``key``, accumulated into ``.grad`` through autograd."""
        group = self._groups.pop(key)
        if not group:
            return
        # one backward call, as the unsplit backward: a weight used twice in a micro batch gets the sum of its
        # two gradients accumulated once (accumulating them one by one would round differently)
        aliases = [weight.view_as(weight) for weight, _, _, _ in group]  # each alias backpropagates to its leaf
        grads = []
        for _, compute, _, origin in group:
            _running.append(origin)
            try:
                grads.append(compute())
            finally:
                _running.pop()
        torch.autograd.backward(aliases, grads)


class _SplitLinear(torch.autograd.Function):
    """``F.linear`` whose weight gradient a :class:`WeightGradStore` may defer."""

    @staticmethod
    def forward(ctx, x, weight, bias, store):
        ctx.save_for_backward(x, weight)
        ctx.store, ctx.has_bias = store, bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_2d = grad.reshape(-1, grad.shape[-1])
        x_2d = x.reshape(-1, x.shape[-1])
        # the products autograd's mm backward forms for F.linear's folded matmul, in the same orientation
        grad_x = grad_2d.mm(weight).view(*x.shape) if ctx.needs_input_grad[0] else None
        grad_bias = grad_2d.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        grad_weight = None
        if ctx.needs_input_grad[1]:
            def compute() -> torch.Tensor:
                return grad_2d.t().mm(x_2d)

            if not ctx.store.defer(weight, compute, (grad_2d, x_2d)):
                grad_weight = compute()
        return grad_x, grad_weight, grad_bias, None


class _DeferredGradient(torch.autograd.Function):
    """Identity forward; backward hands the gradient to a :class:`WeightGradStore` (accumulated in W, with what
    stands between this point and the leaf, such as SP's all-reduce of a norm weight's gradient)."""

    @staticmethod
    def forward(ctx, weight, store):
        ctx.weight, ctx.store = weight, store  # an input (a parameter, or the SP reduction's output): no cycle
        ctx.set_materialize_grads(False)
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad):
        if grad is None or not ctx.store.defer(ctx.weight, lambda: grad, (grad,)):
            return grad, None
        return None, None


def defer_gradient(weight: torch.Tensor, store: WeightGradStore | None) -> torch.Tensor:
    """``weight`` for a kernel whose backward computes the weight's gradient in one piece with the input's (the
    norms): the product stays in B, its accumulation (and any reduction on the way to the leaf) moves to W."""
    return weight if store is None else _DeferredGradient.apply(weight, store)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           store: WeightGradStore | None, float8: Float8Linear | None = None) -> torch.Tensor:
    """``F.linear``; with a store, through the split backward (the weight gradient deferrable); with ``float8``, its
    three GEMMs in float8 (:mod:`llama_megatron.parallel.float8`), the weight gradient deferrable as well."""
    if float8 is not None:
        return float8_linear(x, weight, bias, store, float8)
    if store is None:
        return F.linear(x, weight, bias)
    return _SplitLinear.apply(x, weight, bias, store)


def attach_weight_grad_store(model: nn.Module, store: WeightGradStore | None) -> int:
    """Give ``store`` to every module that takes one (the tensor-parallel linears); returns how many."""
    count = 0
    for module in model.modules():
        if hasattr(module, "weight_grad_store"):
            module.weight_grad_store = store
            count += 1
    return count
