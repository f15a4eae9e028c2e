"""LoRA adapters on the tensor-parallel linears, and the one function that puts them on a model.

Each adapter is the ``lora`` module of a :class:`~llama_megatron.parallel.layers.ColumnParallelLinear` or
:class:`~llama_megatron.parallel.layers.RowParallelLinear`; the layer adds its output to its own (partial)
output. Per target t (HF name), with s = alpha / rank and the shapes of :mod:`.lora_layout`::

    column-parallel (q, k, v, gate, up):  delta_t = (dropout(x) A_t^T) B_t,local^T * s     x = the gathered input
    row-parallel (o, down):               delta   = (dropout(x_local) A_local^T) B^T * s   partial, like x W_local^T

- Column targets: ``A`` is replicated and every rank computes the same ``x A^T``; each rank's part of the
  gradient of ``A`` comes from its own output rows, so ``A`` enters through ``all_reduce_grad_in_tp`` (identity
  forward, all-reduce backward) and autograd sums it. The deltas of a fused linear are laid out as its weight's
  rows: per KV group ``[q | k | v]``, or ``[gate | up]``, zeros for targets without an adapter.
- Row targets: the rank-r partial products are summed over TP by the layer's own all-reduce (or reduce-scatter
  under sequence parallelism), so no collective is added; ``B`` is replicated and each rank's gradient of it is
  a partial sum, so ``B`` enters through ``all_reduce_grad_in_tp`` too.

Dropout (on the adapter input only, as PEFT) draws each mask at the full, unsharded shape from the global RNG
(which every TP rank seeds alike) and keeps this rank's slice, so the masks do not depend on TP; on CPU they are
the masks PEFT draws, target by target in HF's order.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from deepspeed.pipe import PipelineModule
from torch import nn

from llama_megatron.config import ModelConfig
from llama_megatron.model.init import initialize_parameters
from llama_megatron.model.layers import DecoderLayerPipe, EmbeddingPipe
from llama_megatron.model.lora_layout import (
    ADAPTER_MODULE,
    EXPERT_TARGETS,
    LoraConfig,
    adapter_layout,
    adapter_param_name,
    is_adapter_parameter,
    target_shapes,
)
from llama_megatron.model.moe import MoEMLP
from llama_megatron.parallel.collectives import all_reduce_grad_in_tp
from llama_megatron.parallel.context import ParallelContext
from llama_megatron.parallel.degrees import LocalShapes
from llama_megatron.parallel.layers import mark_replicated, mark_tensor_parallel
from llama_megatron.parallel.weight_grad import WeightGradStore, linear


def lora_dropout(x: torch.Tensor, p: float, training: bool, pctx: ParallelContext,
                 sharded: bool = False) -> torch.Tensor:
    """``x * mask / (1 - p)`` (ATen's CPU dropout); ``sharded``: ``x`` is this rank's slice of the last dim, and the
    mask is drawn whole and sliced the same way."""
    if not training or p == 0:
        return x
    shape = list(x.shape)
    if sharded:
        shape[-1] *= pctx.tp_size
    noise = x.new_empty(shape).bernoulli_(1 - p).div_(1 - p)
    if sharded and pctx.tp_size > 1:
        noise = noise.chunk(pctx.tp_size, dim=-1)[pctx.tp_rank]
    return x * noise


class ColumnLoRA(nn.Module):
    """Adapters of the targets fused in one column-parallel linear whose local output is ``groups`` repetitions
    of ``slots`` ((target, rows per group) in weight order)."""

    def __init__(self, in_features: int, slots: list[tuple[str, int]], groups: int, lora: LoraConfig,
                 pctx: ParallelContext, b_split: str = "column") -> None:
        super().__init__()
        self.pctx, self.slots, self.groups = pctx, slots, groups
        self.rank, self.scaling, self.dropout = lora.rank, lora.scaling, lora.dropout
        self.targets = [name for name, _ in slots if name in lora.targets]
        self.weight_grad_store: WeightGradStore | None = None  # set for a zero-bubble schedule (weight_grad.py)
        for name, rows in slots:
            if name in self.targets:
                self.register_parameter(adapter_param_name(name, "A"),
                                        mark_replicated(nn.Parameter(torch.empty(lora.rank, in_features))))
                self.register_parameter(adapter_param_name(name, "B"), mark_tensor_parallel(
                    nn.Parameter(torch.empty(groups * rows, lora.rank)), 0, b_split))

    def _low_rank(self, x: torch.Tensor) -> list[torch.Tensor]:
        """``dropout(x) A_t^T`` per target (one matmul for all targets when nothing is dropped)."""
        a = [getattr(self, adapter_param_name(name, "A")) for name in self.targets]
        if not self.training or self.dropout == 0:
            stacked = all_reduce_grad_in_tp(a[0] if len(a) == 1 else torch.cat(a), self.pctx)
            return list(linear(x, stacked, None, self.weight_grad_store).split(self.rank, dim=-1))
        return [linear(lora_dropout(x, self.dropout, True, self.pctx), all_reduce_grad_in_tp(w, self.pctx), None,
                       self.weight_grad_store) for w in a]

    def low_rank_factors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(A, B)`` of an adapter with one target and no dropout (an expert's gate/up), as :meth:`forward` multiplies
        by them: its output is ``(x A^T) B^T * scaling`` (the grouped experts form it for every expert at once)."""
        (name,) = self.targets
        return (all_reduce_grad_in_tp(getattr(self, adapter_param_name(name, "A")), self.pctx),
                getattr(self, adapter_param_name(name, "B")))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        low_rank = dict(zip(self.targets, self._low_rank(x)))
        lead = x.shape[:-1]
        parts = []
        for name, rows in self.slots:
            if name in low_rank:
                delta = linear(low_rank[name], getattr(self, adapter_param_name(name, "B")), None,
                               self.weight_grad_store) * self.scaling
                parts.append(delta.view(*lead, self.groups, rows))
            else:
                parts.append(x.new_zeros(*lead, self.groups, rows))
        return torch.cat(parts, dim=-1).flatten(-2)


class RowLoRA(nn.Module):
    """The adapter of a row-parallel linear: its partial delta, summed over TP with the layer's output."""

    def __init__(self, target: str, in_features: int, out_features: int, lora: LoraConfig,
                 pctx: ParallelContext) -> None:
        super().__init__()
        self.pctx, self.target = pctx, target
        self.scaling, self.dropout = lora.scaling, lora.dropout
        self.weight_grad_store: WeightGradStore | None = None  # set for a zero-bubble schedule (weight_grad.py)
        self.register_parameter(adapter_param_name(target, "A"), mark_tensor_parallel(
            nn.Parameter(torch.empty(lora.rank, in_features // pctx.tp_size)), 1, "row"))
        self.register_parameter(adapter_param_name(target, "B"),
                                mark_replicated(nn.Parameter(torch.empty(out_features, lora.rank))))

    def low_rank_factors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(A, B)`` as :meth:`forward` multiplies by them without dropout (an expert's down): ``(x A^T) B^T *
        scaling``."""
        return (getattr(self, adapter_param_name(self.target, "A")),
                all_reduce_grad_in_tp(getattr(self, adapter_param_name(self.target, "B")), self.pctx))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = getattr(self, adapter_param_name(self.target, "A"))
        b = all_reduce_grad_in_tp(getattr(self, adapter_param_name(self.target, "B")), self.pctx)
        x = lora_dropout(x, self.dropout, self.training, self.pctx, sharded=True)
        return linear(linear(x, a, None, self.weight_grad_store), b, None, self.weight_grad_store) * self.scaling


def _attach_layer(layer: DecoderLayerPipe, config: ModelConfig, lora: LoraConfig, pctx: ParallelContext,
                  shapes: LocalShapes) -> None:
    hd = config.head_dim
    wanted = set(lora.targets)
    attn, mlp, rows = layer.self_attn, layer.mlp, shapes.intermediate
    if wanted & {"q_proj", "k_proj", "v_proj"}:
        slots = [("q_proj", config.queries_per_group * hd), ("k_proj", hd), ("v_proj", hd)]
        setattr(attn.qkv_proj, ADAPTER_MODULE, ColumnLoRA(config.hidden_size, slots,
                                                          shapes.kv_heads, lora, pctx))
    if isinstance(mlp, MoEMLP):
        _attach_experts(mlp, config, lora, pctx, shapes)
        # the MLP targets of an MoE layer are its shared expert's linears (lora_layout.layer_target), split over TP
        # as the dense MLP's (gate/up rows, down columns) on the gathered tokens, replicated over EP
        mlp, rows = (mlp.shared_expert, shapes.shared_intermediate) if mlp.shared else (None, 0)
    if mlp is not None and wanted & {"gate_proj", "up_proj"}:
        setattr(mlp.gate_up_proj, ADAPTER_MODULE,
                ColumnLoRA(config.hidden_size, [("gate_proj", rows), ("up_proj", rows)], 1, lora, pctx))
    for target, owner in (("o_proj", attn), ("down_proj", mlp)):
        if target in wanted and owner is not None:
            out_features, in_features = target_shapes(config, target, layer.layer_number)
            setattr(getattr(owner, target), ADAPTER_MODULE, RowLoRA(target, in_features, out_features, lora, pctx))


def _attach_experts(moe: MoEMLP, config: ModelConfig, lora: LoraConfig, pctx: ParallelContext,
                    shapes: LocalShapes) -> None:
    """One adapter per expert and adapted parameter (PEFT's ``target_parameters``): gate/up as a column target whose
    ``B`` splits as the expert's weight (gate rows, up rows), down as a row target. An expert's input is the
    gathered tokens every TP rank routes alike, so the dense linears' gradient rules hold unchanged; the adapters are
    expert parameters (reduced over their expert-data-parallel group under EP) like the weights they add to."""
    gate_up, down = EXPERT_TARGETS
    for expert in moe.experts.values():
        if gate_up in lora.targets:
            setattr(expert.gate_up_proj, ADAPTER_MODULE, ColumnLoRA(
                config.hidden_size, [(gate_up, 2 * shapes.expert_intermediate)], 1, lora, pctx, b_split="gate_up"))
        if down in lora.targets:
            out_features, in_features = target_shapes(config, down)
            setattr(expert.down_proj, ADAPTER_MODULE, RowLoRA(down, in_features, out_features, lora, pctx))
    moe.mark_experts()


def _embedding_output_requires_grad(module: nn.Module, args, kwargs, output):
    """With every weight before it frozen, the embedding's output needs no gradient, and DeepSpeed's pipeline
    recomputation (a reentrant checkpoint) then drops the gradients of the adapters inside a recomputed span that
    starts there. Asking for the gradient costs one extra input gradient of the first decoder layer."""
    if kwargs.get("as_lm_head") or not isinstance(output, tuple) or output[0].requires_grad:
        return None
    output[0].requires_grad_(True)
    return output


def attach_lora(model: nn.Module, config: ModelConfig, lora: LoraConfig, pctx: ParallelContext,
                shapes: LocalShapes, seed: int) -> None:
    """Put ``lora``'s adapters on every decoder layer of ``model`` (plain or pipeline form), draw them (A from its
    own seeded generator, as PEFT draws it, sliced for this rank; B zero, so the model starts as the base), and
    freeze every other parameter but the modules to save. Those train in full as they are (the base's weights,
    split and reduced as in full training: vocab-parallel tables, replicated norms whose gradients sequence
    parallelism sums over TP in the norm itself)."""
    for module in model.modules():
        if isinstance(module, DecoderLayerPipe):
            _attach_layer(module, config, lora, pctx, shapes)
    layout = adapter_layout(config, lora)
    trained = {spec.module_name for spec in layout}
    adapters = []
    for name, param in model.named_parameters():
        if is_adapter_parameter(name):
            adapters.append((name, param))
        elif name not in trained:
            param.requires_grad_(False)
    initialize_parameters(adapters, layout, config, pctx, shapes.padded_vocab_size, seed)
    if isinstance(model, PipelineModule) and model.activation_checkpoint_interval:
        for module in model.modules():
            if isinstance(module, EmbeddingPipe):
                module.register_forward_hook(_embedding_output_requires_grad, with_kwargs=True)


@contextlib.contextmanager
def adapters_off(model: nn.Module) -> Iterator[None]:
    """The base model: every adapter's delta scaled by 0 (exactly the base's outputs), as PEFT's
    ``disable_adapter``; the reference of a LoRA preference run, computed before training. Modules to save keep
    their current weights, which are the base's until the first step (PEFT keeps a second copy for this)."""
    modules = [m for m in model.modules() if isinstance(m, (ColumnLoRA, RowLoRA))]
    scalings = [m.scaling for m in modules]
    for m in modules:
        m.scaling = 0.0
    try:
        yield
    finally:
        for m, scaling in zip(modules, scalings):
            m.scaling = scaling
