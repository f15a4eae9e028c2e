"""Megatron tensor-parallel layers: column/row parallel linear and vocab-parallel embedding.

Sharded parameters carry ``tensor_model_parallel=True`` plus ``partition_dim`` so DeepSpeed counts them once per
TP rank in gradient norms. Every parameter also carries ``tp_split``, how it relates to the full tensor (the
model names the fused layouts: ``qkv``, ``gate_up``, ``vocab``; ``row``; ``replicated``), so checkpoint and
initialisation code reads the layout off the parameter instead of guessing it from a name. With sequence parallelism the
activations entering a column-parallel layer are sequence shards (gathered here) and the output of a
row-parallel layer is reduce-scattered back into sequence shards.

Both linears take an optional ``lora`` module (a LoRA adapter, :mod:`llama_megatron.model.lora`): it sees what the
weight multiplies (the gathered input of a column layer, the input shard of a row layer) and its output is added
to this rank's output before any reduction, so it rides on the layer's own collectives.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llama_megatron.parallel.collectives import (
    all_reduce_grad_in_tp,
    copy_to_tp_region,
    gather_from_sequence_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    reduce_scatter_to_sequence_region,
)
from llama_megatron.parallel.context import ParallelContext
from llama_megatron.parallel.float8 import Float8Linear
from llama_megatron.parallel.weight_grad import WeightGradStore, linear


def mark_tensor_parallel(param: nn.Parameter, partition_dim: int, split: str) -> nn.Parameter:
    param.tensor_model_parallel = True
    param.partition_dim = partition_dim
    param.partition_stride = 1
    param.tp_split = split
    return param


def mark_replicated(param: nn.Parameter) -> nn.Parameter:
    param.tp_split = "replicated"
    return param


def column_parallel_input(x: torch.Tensor, pctx: ParallelContext) -> torch.Tensor:
    """What every TP rank multiplies by its rows: the all-gathered sequence under SP; otherwise ``x`` itself,
    with its gradient all-reduced over TP in backward."""
    if pctx.sequence_parallel:
        return gather_from_sequence_region(x, pctx)
    return copy_to_tp_region(x, pctx)


def row_parallel_output(y: torch.Tensor, pctx: ParallelContext) -> torch.Tensor:
    """The sum over TP of partial products: reduce-scattered into sequence shards under SP, else all-reduced."""
    if pctx.sequence_parallel:
        return reduce_scatter_to_sequence_region(y, pctx)
    return reduce_from_tp_region(y, pctx)


def column_parallel_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, pctx: ParallelContext,
                           return_operands: bool = False, store: WeightGradStore | None = None):
    """``x A^T + b`` for a column-parallel ``A`` (its weight gradient deferrable to ``store``); with
    ``return_operands`` the pair (input, weight) instead, for a caller that fuses the matmul with what follows it
    (the chunked loss). Called inside the owning module's forward so ZeRO-3 gathers the weight for it."""
    x = column_parallel_input(x, pctx)
    if return_operands:
        return x, _as_module_output(weight)
    return linear(x, weight, bias, store)


def _as_module_output(param: nn.Parameter) -> torch.Tensor:
    """A parameter handed out of a module's forward, as a non-leaf alias (an autograd view).

    DeepSpeed hooks the gradients of a module's outputs: its backward prologue (which, with the bf16 optimizer,
    clears the low-precision gradients of the previous micro batch) runs at the first such gradient. A bare
    parameter has no autograd node to hook, so its gradient could be accumulated before the prologue and then
    cleared by it. ZeRO-3 finds the partitioned parameter behind the alias through ``ds_param_alias`` and keeps
    it gathered for the caller.
    """
    alias = param.view_as(param)
    if hasattr(param, "ds_id"):
        alias.ds_param_alias = param
    return alias


def _divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} {numerator} is not divisible by tensor parallel size {denominator}")
    return numerator // denominator


class ColumnParallelLinear(nn.Module):
    """``y = x A^T + b`` with A split along its output rows; each rank returns its output slice.

    ``out_features`` is the full (all ranks) size; ``split`` names the layout of the rows (``qkv``, ``gate_up``,
    ``vocab``: the caller's fused layout, recorded on the parameters).
    """

    def __init__(self, in_features: int, out_features: int, pctx: ParallelContext, split: str, bias: bool = False,
                 gather_output: bool = False) -> None:
        super().__init__()
        self.pctx = pctx
        self.gather_output = gather_output
        self.in_features = in_features
        self.out_features_per_rank = _divide(out_features, pctx.tp_size, "output size")
        self.weight = mark_tensor_parallel(nn.Parameter(torch.empty(self.out_features_per_rank, in_features)), 0,
                                           split)
        self.bias = (mark_tensor_parallel(nn.Parameter(torch.zeros(self.out_features_per_rank)), 0, split)
                     if bias else None)
        self.lora: nn.Module | None = None
        self.weight_grad_store: WeightGradStore | None = None  # set for a zero-bubble schedule (weight_grad.py)
        self.float8: Float8Linear | None = None  # set where FP8 training selects this linear (float8.py)

    def forward(self, x: torch.Tensor, return_operands: bool = False):
        """Local output slice (gathered if ``gather_output``); see :func:`column_parallel_matmul` for
        ``return_operands``."""
        if return_operands:
            return column_parallel_matmul(x, self.weight, self.bias, self.pctx, return_operands=True)
        x = column_parallel_input(x, self.pctx)
        y = linear(x, self.weight, self.bias, self.weight_grad_store, self.float8)
        if self.lora is not None:
            y = y + self.lora(x)
        return gather_from_tp_region(y, self.pctx) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """``y = x A^T + b`` with A split along its input columns; the input is already split (output of a column
    layer), partial products are summed over TP (or reduce-scattered into sequence shards)."""

    def __init__(self, in_features: int, out_features: int, pctx: ParallelContext, bias: bool = False) -> None:
        super().__init__()
        self.pctx = pctx
        self.in_features_per_rank = _divide(in_features, pctx.tp_size, "input size")
        self.weight = mark_tensor_parallel(nn.Parameter(torch.empty(out_features, self.in_features_per_rank)), 1,
                                           "row")
        self.bias = mark_replicated(nn.Parameter(torch.zeros(out_features))) if bias else None
        self.lora: nn.Module | None = None
        self.weight_grad_store: WeightGradStore | None = None  # set for a zero-bubble schedule (weight_grad.py)
        self.float8: Float8Linear | None = None  # set where FP8 training selects this linear (float8.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight, None, self.weight_grad_store, self.float8)
        if self.lora is not None:
            y = y + self.lora(x)  # a partial product too: summed over TP with the weight's
        y = row_parallel_output(y, self.pctx)
        if self.bias is None:
            return y
        return y + (all_reduce_grad_in_tp(self.bias, self.pctx) if self.pctx.sequence_parallel else self.bias)


class LocalLinear(nn.Module):
    """``y = x A^T`` with this rank's shard of A and no collective: the caller gathers the input and reduces the
    output once for a group of them (the experts of an MoE layer, :mod:`llama_megatron.model.moe`).
    ``split`` is ``gate_up`` (output rows, the fused layout) or ``row`` (input columns)."""

    def __init__(self, in_features: int, out_features: int, split: str) -> None:
        super().__init__()
        self.weight = mark_tensor_parallel(nn.Parameter(torch.empty(out_features, in_features)),
                                           1 if split == "row" else 0, split)
        self.lora: nn.Module | None = None  # (an expert's adapter: its output is local or partial, as the weight's)
        self.weight_grad_store: WeightGradStore | None = None  # set for a zero-bubble schedule (weight_grad.py)
        self.float8: Float8Linear | None = None  # set where FP8 training selects this linear (float8.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight, None, self.weight_grad_store, self.float8)
        return y if self.lora is None else y + self.lora(x)


class VocabParallelEmbedding(nn.Module):
    """Embedding table split along the (padded) vocabulary; each rank looks up the ids it owns."""

    def __init__(self, padded_vocab_size: int, hidden_size: int, pctx: ParallelContext) -> None:
        super().__init__()
        self.pctx = pctx
        self.rows_per_rank = _divide(padded_vocab_size, pctx.tp_size, "padded vocab size")
        self.vocab_start = pctx.tp_rank * self.rows_per_rank
        self.weight = mark_tensor_parallel(nn.Parameter(torch.empty(self.rows_per_rank, hidden_size)), 0, "vocab")
        # the tied LM head's product may defer its weight gradient (a zero-bubble schedule, weight_grad.py); the
        # lookup's gradient is computed in B: the first stage's B sends nothing back, so deferring it gains nothing
        self.weight_grad_store: WeightGradStore | None = None

    def forward(self, input_ids: torch.Tensor, as_lm_head: bool = False, return_operands: bool = False):
        """Look up ``input_ids``; with ``as_lm_head`` multiply hidden states by the table instead (tied
        embeddings; see :func:`column_parallel_matmul`)."""
        if as_lm_head:
            return column_parallel_matmul(input_ids, self.weight, None, self.pctx, return_operands,
                                          self.weight_grad_store)
        if self.pctx.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local_ids = input_ids - self.vocab_start
        outside = (local_ids < 0) | (local_ids >= self.rows_per_rank)
        hidden = F.embedding(local_ids.masked_fill(outside, 0), self.weight)
        hidden = hidden.masked_fill(outside.unsqueeze(-1), 0.0)
        return row_parallel_output(hidden, self.pctx)
