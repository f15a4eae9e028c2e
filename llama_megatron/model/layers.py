"""The pipeline-stage layers of the LLaMA causal LM.

Every layer takes and returns a tuple of tensors so DeepSpeed can ship it between pipeline stages:
``(hidden, position_ids[, segment_ids])``. Position ids and document ids travel with the hidden states, so
per-document attention and packed positions survive pipeline parallelism. Hidden states are [batch, seq, hidden]
(sequence shards under sequence parallelism); position and segment ids are always full length.
"""

from __future__ import annotations

import torch
from torch import nn

from llama_megatron.config import ModelConfig
from llama_megatron.model.attention import ParallelAttention
from llama_megatron.model.mlp import ParallelMLP
from llama_megatron.model.norm import RMSNorm
from llama_megatron.parallel.collectives import copy_to_tp_region, gather_from_sequence_region
from llama_megatron.parallel.context import ParallelContext
from llama_megatron.parallel.layers import ColumnParallelLinear, VocabParallelEmbedding

Payload = tuple[torch.Tensor, ...]


class EmbeddingPipe(nn.Module):
    """Input ids -> hidden states. Input payload: ``(input_ids, position_ids[, segment_ids])``."""

    def __init__(self, config: ModelConfig, pctx: ParallelContext, padded_vocab_size: int) -> None:
        super().__init__()
        self.pctx = pctx
        self.word_embeddings = VocabParallelEmbedding(padded_vocab_size, config.hidden_size, pctx)

    def forward(self, inputs: Payload | torch.Tensor, as_lm_head: bool = False) -> Payload | torch.Tensor:
        if as_lm_head:
            return self._lm_head(inputs)
        input_ids, *rest = inputs
        return (self.word_embeddings(input_ids), *rest)

    def _lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.pctx.sequence_parallel:
            hidden = gather_from_sequence_region(hidden, self.pctx)
        else:
            hidden = copy_to_tp_region(hidden, self.pctx)
        return torch.nn.functional.linear(hidden, self.word_embeddings.weight)


def tied_lm_head_forward(embedding: EmbeddingPipe, hidden: torch.Tensor) -> torch.Tensor:
    """LM head reusing the vocab-parallel embedding table: local logits [b, s, padded_vocab / tp].

    It goes through the embedding module's ``__call__`` so ZeRO-3 gathers the shared table for it too.
    """
    return embedding(hidden, as_lm_head=True)


class DecoderLayerPipe(nn.Module):
    def __init__(self, config: ModelConfig, pctx: ParallelContext, layer_number: int) -> None:
        super().__init__()
        self.layer_number = layer_number
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, pctx)
        self.self_attn = ParallelAttention(config, pctx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, pctx)
        self.mlp = ParallelMLP(config, pctx)

    def forward(self, inputs: Payload) -> Payload:
        hidden, position_ids, *rest = inputs
        segment_ids = rest[0] if rest else None
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), position_ids, segment_ids)
        hidden = hidden + self.mlp(self.post_attention_layernorm(hidden))
        return (hidden, position_ids, *rest)


class FinalNormPipe(nn.Module):
    """Final RMSNorm; drops the position/segment ids, which the head does not need."""

    def __init__(self, config: ModelConfig, pctx: ParallelContext) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, pctx)

    def forward(self, inputs: Payload) -> torch.Tensor:
        return self.norm(inputs[0])


class LMHeadPipe(nn.Module):
    """Untied LM head: column-parallel over the padded vocab, returns local logits (never gathered)."""

    def __init__(self, config: ModelConfig, pctx: ParallelContext, padded_vocab_size: int) -> None:
        super().__init__()
        self.lm_head = ColumnParallelLinear(config.hidden_size, padded_vocab_size, pctx, "vocab", bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
