"""The pipeline-stage layers of the LLaMA causal LM.

Every layer takes and returns a tuple of tensors so DeepSpeed can ship it between pipeline stages:
``(hidden, position_ids[, segment_ids][, router_stats])``. Position ids and document ids travel with the hidden
states, so per-document attention and packed positions survive pipeline parallelism; a mixture-of-experts model
adds its router statistics (``[3, experts]`` fp32, :mod:`llama_megatron.model.moe`), which every MoE layer adds to
and the loss reads. Hidden states are [batch, seq, hidden]:
this context-parallel rank's sequence shard (of input ids too), cut again over TP under sequence parallelism;
position and segment ids are always full length (attention needs the whole sequence's after its all-to-all).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from llama_megatron.config import ModelConfig
from llama_megatron.model.attention import ParallelAttention
from llama_megatron.model.kernels import REFERENCE, Kernels
from llama_megatron.model.kv_cache import LayerKVCache
from llama_megatron.model.latent_attention import LatentAttention
from llama_megatron.model.mlp import ParallelMLP
from llama_megatron.model.moe import MoEMLP
from llama_megatron.model.norm import RMSNorm
from llama_megatron.parallel.context import ParallelContext
from llama_megatron.parallel.degrees import LocalShapes
from llama_megatron.parallel.layers import ColumnParallelLinear, VocabParallelEmbedding

Payload = tuple[torch.Tensor, ...]


class RoutedHeadOutput(NamedTuple):
    """The LM head's output of a mixture-of-experts model, with the router statistics of all its layers. A tuple:
    DeepSpeed finds the tensors of a module's output (it hooks their gradients: its backward prologue, which clears
    the bf16 optimizer's per-micro-batch gradients, runs at the first one) only in tuples, lists and dicts."""

    head: torch.Tensor | tuple[torch.Tensor, torch.Tensor]
    router_stats: torch.Tensor


# local logits, or (head input, weight shard); with router statistics for an MoE model
HeadOutput = torch.Tensor | tuple[torch.Tensor, torch.Tensor] | RoutedHeadOutput


def _routed(head_fn, inputs: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> HeadOutput:
    """Apply the head to the final norm's output, carrying an MoE model's router statistics past it."""
    if isinstance(inputs, tuple):
        hidden, stats = inputs
        return RoutedHeadOutput(head_fn(hidden), stats)
    return head_fn(inputs)


class EmbeddingPipe(nn.Module):
    """Input ids -> hidden states. Input payload: ``(input_ids, position_ids[, segment_ids])``."""

    def __init__(self, config: ModelConfig, pctx: ParallelContext, shapes: LocalShapes,
                 kernels: Kernels = REFERENCE) -> None:
        super().__init__()
        self.kernels = kernels
        self.experts = config.num_local_experts if config.family.moe else 0
        self.word_embeddings = VocabParallelEmbedding(shapes.padded_vocab_size, config.hidden_size, pctx)

    def forward(self, inputs: Payload | torch.Tensor, as_lm_head: bool = False) -> Payload | HeadOutput:
        if as_lm_head:  # the table's own module call, so ZeRO-3 gathers it for the head too
            return _routed(lambda hidden: self.word_embeddings(hidden, as_lm_head=True,
                                                               return_operands=self.kernels.fused_loss), inputs)
        input_ids, *rest = inputs
        hidden = self.word_embeddings(input_ids)
        if self.experts:  # the router statistics start here (see the module docstring)
            rest.append(torch.zeros(3, self.experts, device=hidden.device))
        return (hidden, *rest)


def tied_lm_head_forward(embedding: EmbeddingPipe, hidden: torch.Tensor) -> HeadOutput:
    """LM head reusing the vocab-parallel embedding table (outputs as :class:`LMHeadPipe`)."""
    return embedding(hidden, as_lm_head=True)


class DecoderLayerPipe(nn.Module):
    def __init__(self, config: ModelConfig, pctx: ParallelContext, shapes: LocalShapes, layer_number: int,
                 kernels: Kernels = REFERENCE) -> None:
        super().__init__()
        self.layer_number = layer_number
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, pctx, kernels)
        attention = LatentAttention if config.family.latent_attention else ParallelAttention
        self.self_attn = attention(config, pctx, shapes, kernels, layer_number)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, pctx, kernels)
        self.carries_stats = config.family.moe is not None  # every layer passes them on, dense ones (Qwen's) too
        self.moe = config.is_moe_layer(layer_number)
        self.mlp = MoEMLP(config, pctx, shapes, kernels) if self.moe else ParallelMLP(config, pctx, kernels)

    def forward(self, inputs: Payload, kv_cache: LayerKVCache | None = None) -> Payload:
        hidden, position_ids, *rest = inputs
        stats = rest.pop() if self.carries_stats else None
        segment_ids = rest[0] if rest else None
        attention = self.self_attn(self.input_layernorm(hidden), position_ids, segment_ids, kv_cache)
        hidden, normed = self.post_attention_layernorm(attention, residual=hidden)  # one fused kernel when fast
        if self.moe:
            out, layer_stats = self.mlp(normed)
            return (hidden + out, position_ids, *rest, stats + layer_stats)
        hidden = hidden + self.mlp(normed)
        return (hidden, position_ids, *rest) if stats is None else (hidden, position_ids, *rest, stats)


class FinalNormPipe(nn.Module):
    """Final RMSNorm; drops the position/segment ids, which the head does not need (an MoE model's router
    statistics go on, as ``(normed, router_stats)``)."""

    def __init__(self, config: ModelConfig, pctx: ParallelContext, kernels: Kernels = REFERENCE) -> None:
        super().__init__()
        self.moe = config.family.moe is not None
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, pctx, kernels)

    def forward(self, inputs: Payload) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        normed = self.norm(inputs[0])
        return (normed, inputs[-1]) if self.moe else normed


class LMHeadPipe(nn.Module):
    """Untied LM head: column-parallel over the padded vocab; local logits [b, s, padded_vocab / tp], never
    gathered. With the fused loss it returns (this rank's head input, weight shard) instead, from which the loss
    computes the logits chunk by chunk."""

    def __init__(self, config: ModelConfig, pctx: ParallelContext, shapes: LocalShapes,
                 kernels: Kernels = REFERENCE) -> None:
        super().__init__()
        self.kernels = kernels
        self.lm_head = ColumnParallelLinear(config.hidden_size, shapes.padded_vocab_size, pctx, "vocab", bias=False)

    def forward(self, hidden: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> HeadOutput:
        return _routed(lambda x: self.lm_head(x, return_operands=self.kernels.fused_loss), hidden)
