"""The pipeline-stage layers of the LLaMA causal LM.

Every layer takes and returns a tuple of tensors so DeepSpeed can ship it between pipeline stages:
``(hidden, position_ids[, segment_ids])``. Position ids and document ids travel with the hidden states, so
per-document attention and packed positions survive pipeline parallelism. Hidden states are [batch, seq, hidden]:
this context-parallel rank's sequence shard (of input ids too), cut again over TP under sequence parallelism;
position and segment ids are always full length (attention needs the whole sequence's after its all-to-all).
"""

from __future__ import annotations

import torch
from torch import nn

from llama_megatron.config import LocalShapes, ModelConfig
from llama_megatron.model.attention import ParallelAttention
from llama_megatron.model.kernels import REFERENCE, Kernels
from llama_megatron.model.kv_cache import LayerKVCache
from llama_megatron.model.mlp import ParallelMLP
from llama_megatron.model.norm import RMSNorm
from llama_megatron.parallel.context import ParallelContext
from llama_megatron.parallel.layers import ColumnParallelLinear, VocabParallelEmbedding

Payload = tuple[torch.Tensor, ...]
HeadOutput = torch.Tensor | tuple[torch.Tensor, torch.Tensor]  # local logits, or (head input, weight shard)


class EmbeddingPipe(nn.Module):
    """Input ids -> hidden states. Input payload: ``(input_ids, position_ids[, segment_ids])``."""

    def __init__(self, config: ModelConfig, pctx: ParallelContext, shapes: LocalShapes,
                 kernels: Kernels = REFERENCE) -> None:
        super().__init__()
        self.kernels = kernels
        self.word_embeddings = VocabParallelEmbedding(shapes.padded_vocab_size, config.hidden_size, pctx)

    def forward(self, inputs: Payload | torch.Tensor, as_lm_head: bool = False) -> Payload | HeadOutput:
        if as_lm_head:  # the table's own module call, so ZeRO-3 gathers it for the head too
            return self.word_embeddings(inputs, as_lm_head=True, return_operands=self.kernels.fused_loss)
        input_ids, *rest = inputs
        return (self.word_embeddings(input_ids), *rest)


def tied_lm_head_forward(embedding: EmbeddingPipe, hidden: torch.Tensor) -> HeadOutput:
    """LM head reusing the vocab-parallel embedding table (outputs as :class:`LMHeadPipe`)."""
    return embedding(hidden, as_lm_head=True)


class DecoderLayerPipe(nn.Module):
    def __init__(self, config: ModelConfig, pctx: ParallelContext, shapes: LocalShapes, layer_number: int,
                 kernels: Kernels = REFERENCE) -> None:
        super().__init__()
        self.layer_number = layer_number
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, pctx, kernels)
        self.self_attn = ParallelAttention(config, pctx, shapes, kernels, layer_number)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, pctx, kernels)
        self.mlp = ParallelMLP(config, pctx, kernels)

    def forward(self, inputs: Payload, kv_cache: LayerKVCache | None = None) -> Payload:
        hidden, position_ids, *rest = inputs
        segment_ids = rest[0] if rest else None
        attention = self.self_attn(self.input_layernorm(hidden), position_ids, segment_ids, kv_cache)
        hidden, normed = self.post_attention_layernorm(attention, residual=hidden)  # one fused kernel when fast
        hidden = hidden + self.mlp(normed)
        return (hidden, position_ids, *rest)


class FinalNormPipe(nn.Module):
    """Final RMSNorm; drops the position/segment ids, which the head does not need."""

    def __init__(self, config: ModelConfig, pctx: ParallelContext, kernels: Kernels = REFERENCE) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, pctx, kernels)

    def forward(self, inputs: Payload) -> torch.Tensor:
        return self.norm(inputs[0])


class LMHeadPipe(nn.Module):
    """Untied LM head: column-parallel over the padded vocab; local logits [b, s, padded_vocab / tp], never
    gathered. With the fused loss it returns (this rank's head input, weight shard) instead, from which the loss
    computes the logits chunk by chunk."""

    def __init__(self, config: ModelConfig, pctx: ParallelContext, shapes: LocalShapes,
                 kernels: Kernels = REFERENCE) -> None:
        super().__init__()
        self.kernels = kernels
        self.lm_head = ColumnParallelLinear(config.hidden_size, shapes.padded_vocab_size, pctx, "vocab", bias=False)

    def forward(self, hidden: torch.Tensor) -> HeadOutput:
        return self.lm_head(hidden, return_operands=self.kernels.fused_loss)
