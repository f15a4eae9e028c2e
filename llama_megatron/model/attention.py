"""Grouped-query self-attention with a fused, column-parallel QKV projection.

Fused QKV layout (Megatron-LM / Megatron-DeepSpeed GQA layout, so converted checkpoints interoperate). With
g = num_heads / num_kv_heads query heads per KV group, TP rank r owns KV groups j in
[r * nkv / tp, (r + 1) * nkv / tp) and its weight rows are, group after group::

    [ q heads j*g .. j*g+g-1 | k head j | v head j ]      each head = head_dim rows

so a rank's output reshapes to [batch, seq, nkv_local, g + 2, head_dim] with no communication.

Family options (:mod:`llama_megatron.families`): biases on q/k/v and on o, each on its own (Qwen2 has the first
only); Qwen3's RMSNorm over each q and k head before RoPE; the layer's sliding window, handed to the kernel. Llama
4's per layer: RoPE or none (NoPE), a weightless L2 norm of q and k after RoPE, the queries of NoPE layers scaled by
the attention temperature of their position, and attention in chunks (run as per-document attention over the
chunks, :func:`~llama_megatron.model.kernels.attention.chunk_segment_ids`).

q and k are rotated and attention computed by the kernel seam (:mod:`llama_megatron.model.kernels`); per-document
causal attention inside a packed sequence uses ``segment_ids`` (document index per token). Under context
parallelism ``hidden`` holds this CP rank's sequence shard: q and k are rotated with the shard's own positions
(``position_ids`` is full length), then the kernel runs on full sequences for a share of the heads through
DeepSpeed-Ulysses (:mod:`llama_megatron.parallel.context_parallel`).
"""

from __future__ import annotations

import torch
from torch import nn

from llama_megatron.config import ModelConfig
from llama_megatron.model.kernels import REFERENCE, Kernels
from llama_megatron.model.kernels.attention import chunk_segment_ids
from llama_megatron.model.kernels.reference import split_qkv
from llama_megatron.model.kv_cache import LayerKVCache
from llama_megatron.model.norm import RMSNorm, l2_norm
from llama_megatron.model.rope import rotary_cos_sin
from llama_megatron.parallel.context import ParallelContext
from llama_megatron.parallel.context_parallel import UlyssesAttention, context_shard
from llama_megatron.parallel.degrees import LocalShapes
from llama_megatron.parallel.layers import ColumnParallelLinear, RowParallelLinear


class ParallelAttention(nn.Module):
    def __init__(self, config: ModelConfig, pctx: ParallelContext, shapes: LocalShapes,
                 kernels: Kernels = REFERENCE, layer: int = 0) -> None:
        super().__init__()
        self.config = config
        self.pctx = pctx
        self.kernels = kernels
        hd = config.head_dim
        self.groups_per_rank = shapes.kv_heads
        self.queries_per_group = config.queries_per_group
        qkv_rows = (config.num_attention_heads + 2 * config.num_key_value_heads) * hd
        family = config.family
        self.window, self.chunk = family.window(config, layer), family.chunk(config, layer)
        self.rope, self.l2_qk_norm = family.rope(config, layer), family.l2_qk_norm(config, layer)
        self.temperature = family.temperature(config, layer)
        self.qkv_proj = ColumnParallelLinear(config.hidden_size, qkv_rows, pctx, "qkv", bias=config.qkv_bias)
        # the q, k and v rows of the local [groups, queries + 2, head_dim] layout: what FP8 scales apart (float8.py)
        rows = torch.arange(self.qkv_proj.out_features_per_rank).view(self.groups_per_rank, -1, hd)
        g = self.queries_per_group
        self.qkv_proj.output_parts = [rows[:, :g].reshape(-1), rows[:, g].reshape(-1), rows[:, g + 1].reshape(-1)]
        self.o_proj = RowParallelLinear(config.num_attention_heads * hd, config.hidden_size, pctx,
                                        bias=config.o_bias)
        if config.qk_norm:  # replicated weights, each TP rank normalising its own heads: gradients summed over TP
            self.q_norm, self.k_norm = (RMSNorm(hd, config.rms_norm_eps, pctx, kernels, partial_over_tp=True)
                                        for _ in range(2))
        # (q, k, v, segment_ids) -> attention output: the kernel itself, or the kernel on full sequences over CP
        self.attention = (kernels.attention if pctx.cp_size == 1 else
                          UlyssesAttention(kernels.attention, pctx, shapes.kv_repeats))

    def forward(self, hidden: torch.Tensor, position_ids: torch.Tensor,
                segment_ids: torch.Tensor | None = None, kv_cache: LayerKVCache | None = None) -> torch.Tensor:
        """``kv_cache`` (generation): keys and values of the earlier positions, extended with this call's."""
        qkv = self.qkv_proj(hidden)
        b, s = qkv.shape[:2]
        qkv = qkv.view(b, s, self.groups_per_rank, self.queries_per_group + 2, self.config.head_dim)
        if self.config.qk_norm:
            g = self.queries_per_group
            qkv = torch.cat([self.q_norm(qkv[:, :, :, :g]), self.k_norm(qkv[:, :, :, g:g + 1]), qkv[:, :, :, g + 1:]],
                            dim=3)
        if self.rope:
            cos, sin = rotary_cos_sin(self.config, position_ids, self.pctx.cp_rank, self.pctx.cp_size)
            q, k, v = self.kernels.rotary_qkv(qkv, cos, sin)
        else:
            q, k, v = (t.contiguous() for t in split_qkv(qkv))
        if self.l2_qk_norm:
            q, k = l2_norm(q, self.config.rms_norm_eps), l2_norm(k, self.config.rms_norm_eps)
        if self.temperature:
            q = attention_temperature(q, context_shard(position_ids, self.pctx.cp_rank, self.pctx.cp_size, dim=-1),
                                      self.config)
        if kv_cache is None:
            if self.chunk is not None:
                segment_ids = chunk_segment_ids(segment_ids, position_ids, self.chunk)
            # Ulysses over CP, or the kernel alone where the forward takes whole sequences (pctx.whole_sequences)
            attend = self.attention if self.pctx.cp_size > 1 else self.kernels.attention
            out = attend(q, k, v, segment_ids, self.window)
        else:
            keys, values, first_key = kv_cache.append(k, v)
            out = self.kernels.attention.after(q, keys, values, self.window, self.chunk, first_key)
        return self.o_proj(out.reshape(b, s, -1))


def attention_temperature(q: torch.Tensor, positions: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """Llama 4's NoPE layers (HF's ``attn_temperature_tuning``): each query scaled by
    ``1 + attn_scale x log1p(floor((position + 1) / floor_scale))``, in fp32 and cast back; ``positions`` [b, s]
    are the tokens' own (a packed document's count from its start, as if it ran alone)."""
    scales = torch.log1p(torch.floor((positions.float() + 1.0) / config.floor_scale)) * config.attn_scale + 1.0
    return (q * scales[:, :, None, None]).to(q.dtype)
