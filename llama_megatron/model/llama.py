"""The LLaMA causal LM as one layer list, built either as a plain module or as a DeepSpeed PipelineModule.

Layer indices (they name parameters and pipeline checkpoint files, so they are stable):
0 = embedding, 1..L = decoder layers, L+1 = final norm, L+2 = LM head. With tied embeddings, layers 0 and L+2
are one ``TiedLayerSpec`` keyed ``"embed"`` (parameters under ``tied_modules.embed``).
The plain module registers its layers under exactly the names PipelineModule uses, so state dicts, the HF
mapping and initialisation are shared by both forms.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Protocol

import torch
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from torch import nn
from torch.utils.checkpoint import checkpoint

from llama_megatron.config import ModelConfig
from llama_megatron.model.chunked_pipeline import ChunkedPipelineModule
from llama_megatron.model.kernels import REFERENCE, Kernels
from llama_megatron.model.kv_cache import KVCache
from llama_megatron.model.layers import (
    DecoderLayerPipe,
    EmbeddingPipe,
    FinalNormPipe,
    HeadOutput,
    LMHeadPipe,
    RoutedHeadOutput,
    tied_lm_head_forward,
)
from llama_megatron.model.moe import router_aux_loss
from llama_megatron.parallel.collectives import gather_from_tp_region
from llama_megatron.parallel.context import ParallelContext
from llama_megatron.parallel.cross_entropy import IGNORE_INDEX, masked_mean_loss, vocab_parallel_cross_entropy
from llama_megatron.parallel.degrees import LocalShapes
from llama_megatron.parallel.linear_cross_entropy import linear_cross_entropy_sum
from llama_megatron.parallel.pipeline_stages import StagePlacement
from llama_megatron.quiet import without_deepspeed_prints

TIED_KEY = "embed"


class CausalLMLoss:
    """Cross-entropy of the head's output (the PipelineModule ``loss_fn``): over vocab-parallel logits, or, when the
    head hands over (input, weight), chunk by chunk without full logits.

    ``labels`` is a tensor (the micro batch's token mean, HF's reduction) or ``(labels, divisor)``: the sum of the
    micro batch's token losses divided by ``divisor``, which the training engine sets so that the step's loss is the
    token mean over its whole global batch (training/engine/training_engine.py, "the loss rule").

    A training objective other than the token mean (preference pairs, GRPO: training/objectives.py) sets
    ``objective``: a loss of the per-token values (:class:`ObjectiveLoss`), whose targets ``labels`` then are; a
    chunked head's logits are made whole for it (each token's gradient is scaled by its sequence's).

    A mixture-of-experts model adds the load-balancing loss when its config says so (``output_router_logits``, as
    HF's MixtralForCausalLM does), computed per micro batch (:func:`~llama_megatron.model.moe.router_aux_loss`).
    """

    def __init__(self, config: ModelConfig, pctx: ParallelContext) -> None:
        self.config = config
        self.vocab_size = config.vocab_size
        self.pctx = pctx
        # assignments and dropped assignments per expert since the last reset ([2, E], MoE)
        self.expert_counts: torch.Tensor | None = None
        self.objective: ObjectiveLoss | None = None  # set by the engine from the run's objective
        self.metric_sums: torch.Tensor | None = None  # sums of the objective's metric_names since the last reset

    def __call__(self, head: HeadOutput, labels: torch.Tensor | tuple) -> torch.Tensor:
        aux = None
        if isinstance(head, RoutedHeadOutput):
            counts = head.router_stats[0::2].detach()  # assignments and dropped ones: this rank's tokens, every layer
            self.expert_counts = counts if self.expert_counts is None else self.expert_counts + counts
            if self.config.output_router_logits:
                aux = router_aux_loss(head.router_stats, self.config, self.pctx)
            else:  # no aux loss, but a gradient (of zeros) for the statistics a pipeline stage received
                aux = 0.0 * head.router_stats[1].sum()
            head = head.head
        loss = self._objective_loss(head, labels) if self.objective is not None else self._cross_entropy(head, labels)
        return loss if aux is None else loss + aux

    def _cross_entropy(self, head: torch.Tensor | tuple, labels: torch.Tensor | tuple) -> torch.Tensor:
        labels, divisor = labels if isinstance(labels, (tuple, list)) else (labels, None)
        if isinstance(head, tuple):
            hidden, weight = head
            total = linear_cross_entropy_sum(hidden, weight, labels, self.pctx, self.vocab_size, IGNORE_INDEX)
        else:
            total = vocab_parallel_cross_entropy(head, labels, self.pctx, self.vocab_size, IGNORE_INDEX)
        if divisor is None:
            return masked_mean_loss(total, labels, IGNORE_INDEX)
        return total.sum() / divisor

    def _objective_loss(self, head: torch.Tensor | tuple, targets: tuple) -> torch.Tensor:
        loss, sums = self.objective(logits_of(head), targets)
        self.metric_sums = sums if self.metric_sums is None else self.metric_sums + sums
        return loss


class ObjectiveLoss(Protocol):
    """A training objective's loss of a micro batch from this rank's vocab shard of its ``logits`` (with their
    graph) and its ``targets`` (a tuple of tensors, the labels first, as DeepSpeed's pipeline moves them): the loss
    and a vector of ``metric_size`` sums its metrics are made of (detached; summed over ranks by the engine)."""

    metric_size: int

    def __call__(self, logits: torch.Tensor, targets: tuple) -> tuple[torch.Tensor, torch.Tensor]: ...


def logits_of(head: HeadOutput) -> torch.Tensor:
    """This rank's vocab shard of the logits from the head's output (any form)."""
    if isinstance(head, RoutedHeadOutput):
        head = head.head
    if isinstance(head, tuple):
        hidden, weight = head
        return torch.nn.functional.linear(hidden, weight)
    return head


def layer_specs(config: ModelConfig, pctx: ParallelContext, shapes: LocalShapes,
                kernels: Kernels = REFERENCE) -> list[LayerSpec]:
    if config.tie_word_embeddings:
        embed = TiedLayerSpec(TIED_KEY, EmbeddingPipe, config, pctx, shapes, kernels,
                              tied_weight_attr="word_embeddings.weight")
        head = TiedLayerSpec(TIED_KEY, EmbeddingPipe, config, pctx, shapes, kernels,
                             forward_fn=tied_lm_head_forward, tied_weight_attr="word_embeddings.weight")
    else:
        embed = LayerSpec(EmbeddingPipe, config, pctx, shapes, kernels)
        head = LayerSpec(LMHeadPipe, config, pctx, shapes, kernels)
    decoder = [LayerSpec(DecoderLayerPipe, config, pctx, shapes, i, kernels) for i in range(config.num_hidden_layers)]
    return [embed, *decoder, LayerSpec(FinalNormPipe, config, pctx, kernels), head]


class LlamaCausalLM(nn.Module):
    """The whole model in one process group stage (PP=1): the same layers, run in order."""

    def __init__(self, config: ModelConfig, pctx: ParallelContext, shapes: LocalShapes,
                 activation_checkpoint_interval: int = 0, kernels: Kernels = REFERENCE) -> None:
        super().__init__()
        if pctx.pp_size != 1:
            raise ValueError("LlamaCausalLM is the PP=1 form; use build_pipeline_module for PP>1")
        self.config = config
        self.pctx = pctx
        self.shapes = shapes
        self.activation_checkpoint_interval = activation_checkpoint_interval
        self.loss_fn = CausalLMLoss(config, pctx)
        self.tied_modules = nn.ModuleDict()
        self._forward_funcs: list = []
        for idx, spec in enumerate(layer_specs(config, pctx, shapes, kernels)):
            if isinstance(spec, TiedLayerSpec):
                if spec.key not in self.tied_modules:
                    self.tied_modules[spec.key] = spec.build()
                module = self.tied_modules[spec.key]
                self._forward_funcs.append(partial(spec.forward_fn, module) if spec.forward_fn else module)
            else:
                module = spec.build()
                self.add_module(str(idx), module)
                self._forward_funcs.append(module)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                segment_ids: torch.Tensor | None = None, labels: torch.Tensor | tuple | None = None) -> torch.Tensor:
        """The loss when ``labels`` (or ``(labels, divisor)``, see CausalLMLoss) are given, else this rank's vocab
        shard of the logits."""
        if position_ids is None:  # full length; under context parallelism input_ids is this rank's shard
            seq = input_ids.shape[1] * self.pctx.cp_size
            position_ids = torch.arange(seq, device=input_ids.device).expand(input_ids.shape[0], seq)
        x = (input_ids, position_ids) if segment_ids is None else (input_ids, position_ids, segment_ids)
        span: list = []
        for fn in self._forward_funcs:
            if self.activation_checkpoint_interval and self.training and isinstance(fn, DecoderLayerPipe):
                span.append(fn)  # recompute spans of `interval` decoder layers, as PipelineModule does
                if len(span) == self.activation_checkpoint_interval:
                    x, span = checkpoint(_run_layers, span, x, use_reentrant=False), []
                continue
            if span:
                x, span = checkpoint(_run_layers, span, x, use_reentrant=False), []
            x = fn(x)
        return logits_of(x) if labels is None else self.loss_fn(x, labels)

    @torch.no_grad()
    def forward_cached(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Local logits of ``input_ids`` that follow the positions held in ``cache`` (extended here): generation."""
        x: tuple | torch.Tensor = (input_ids, position_ids)
        layers = iter(cache.layers)
        for fn in self._forward_funcs:
            x = fn(x, kv_cache=next(layers)) if isinstance(fn, DecoderLayerPipe) else fn(x)
        return logits_of(x)

    def full_logits(self, local_logits: torch.Tensor) -> torch.Tensor:
        """Gather the vocab shards and drop the padding (for evaluation and tests, not for the loss)."""
        return gather_from_tp_region(local_logits, self.pctx)[..., : self.config.vocab_size]


def _run_layers(layers: list, x):
    for layer in layers:
        x = layer(x)
    return x


def build_pipeline_module(config: ModelConfig, pctx: ParallelContext, shapes: LocalShapes,
                          partition_method: str = "type:DecoderLayerPipe",
                          activation_checkpoint_interval: int = 0, kernels: Kernels = REFERENCE,
                          placement: StagePlacement | None = None,
                          stage_layers: Sequence[int] | None = None) -> PipelineModule:
    """The PP>1 form over ``pctx.topology``; only decoder layers are ever recomputed. With a ``placement`` (the
    schedules of our engine) a :class:`ChunkedPipelineModule` holding this rank's virtual stages. DeepSpeed's prints
    of its seed settings and of every stage's layers are dropped (``LLAMA_MEGATRON_VERBOSE=1`` keeps them)."""
    kwargs = dict(layers=layer_specs(config, pctx, shapes, kernels), loss_fn=CausalLMLoss(config, pctx),
                  topology=pctx.topology, partition_method=partition_method,
                  activation_checkpoint_interval=activation_checkpoint_interval,
                  checkpointable_layers=["DecoderLayerPipe"])
    with without_deepspeed_prints():
        if placement is None:
            return PipelineModule(**kwargs)
        return ChunkedPipelineModule(placement=placement, stage_layers=stage_layers, **kwargs)
