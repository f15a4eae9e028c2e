"""Grouped-query self-attention with a fused, column-parallel QKV projection.

Fused QKV layout (Megatron-LM / Megatron-DeepSpeed GQA layout, so converted checkpoints interoperate). With
g = num_heads / num_kv_heads query heads per KV group, TP rank r owns KV groups j in
[r * nkv / tp, (r + 1) * nkv / tp) and its weight rows are, group after group::

    [ q heads j*g .. j*g+g-1 | k head j | v head j ]      each head = head_dim rows

so a rank's output reshapes to [batch, seq, nkv_local, g + 2, head_dim] with no communication.

Kernels: FlashAttention-2 when ``flash_attn`` imports and inputs are CUDA fp16/bf16; otherwise
``scaled_dot_product_attention``. Per-document causal attention inside a packed sequence uses ``segment_ids``
(document index per token): a block-diagonal causal mask for SDPA, ``flash_attn_varlen_func`` for flash.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llama_megatron.config import ModelConfig
from llama_megatron.model.rope import apply_rotary, rotary_cos_sin
from llama_megatron.parallel.context import ParallelContext
from llama_megatron.parallel.layers import ColumnParallelLinear, RowParallelLinear

try:  # pragma: no cover - CUDA only
    from flash_attn import flash_attn_func, flash_attn_varlen_func

    HAVE_FLASH_ATTN = True
except Exception:  # ImportError, or a broken CUDA build
    HAVE_FLASH_ATTN = False


def use_flash_attention(q: torch.Tensor) -> bool:
    return HAVE_FLASH_ATTN and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)


def document_causal_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """Boolean [batch, 1, seq, seq] mask: causal and within the same document."""
    seq = segment_ids.shape[-1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=segment_ids.device).tril()
    same_doc = segment_ids.unsqueeze(-1) == segment_ids.unsqueeze(-2)
    return (same_doc & causal).unsqueeze(1)


def _cu_seqlens(segment_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Cumulative lengths of the documents of every row, flattened (flash-attn varlen input)."""
    batch, seq = segment_ids.shape
    starts = torch.ones_like(segment_ids, dtype=torch.bool)
    starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    start_positions = starts.flatten().nonzero().flatten()
    ends = torch.cat([start_positions[1:], start_positions.new_tensor([batch * seq])])
    cu = torch.cat([start_positions.new_zeros(1), ends]).to(torch.int32)
    max_len = int((ends - start_positions).max())
    return cu, max_len


def core_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   segment_ids: torch.Tensor | None) -> torch.Tensor:
    """q [b, s, hq, d], k/v [b, s, hkv, d] -> [b, s, hq, d], causal (per document when segment_ids given)."""
    if use_flash_attention(q):  # pragma: no cover - CUDA only
        if segment_ids is None:
            return flash_attn_func(q, k, v, causal=True)
        b, s = segment_ids.shape
        cu, max_len = _cu_seqlens(segment_ids)
        out = flash_attn_varlen_func(
            q.reshape(b * s, *q.shape[2:]), k.reshape(b * s, *k.shape[2:]), v.reshape(b * s, *v.shape[2:]),
            cu, cu, max_len, max_len, causal=True,
        )
        return out.view(b, s, *out.shape[1:])
    groups = q.shape[2] // k.shape[2]
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    if segment_ids is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=document_causal_mask(segment_ids))
    return out.transpose(1, 2)


class ParallelAttention(nn.Module):
    def __init__(self, config: ModelConfig, pctx: ParallelContext) -> None:
        super().__init__()
        self.config = config
        self.pctx = pctx
        hd = config.head_dim
        self.groups_per_rank = config.num_key_value_heads // pctx.tp_size
        self.queries_per_group = config.queries_per_group
        qkv_rows = (config.num_attention_heads + 2 * config.num_key_value_heads) * hd
        self.qkv_proj = ColumnParallelLinear(config.hidden_size, qkv_rows, pctx, "qkv", bias=config.attention_bias)
        self.o_proj = RowParallelLinear(config.num_attention_heads * hd, config.hidden_size, pctx,
                                        bias=config.attention_bias)

    def forward(self, hidden: torch.Tensor, position_ids: torch.Tensor,
                segment_ids: torch.Tensor | None = None) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        b, s = qkv.shape[:2]
        g, hd = self.queries_per_group, self.config.head_dim
        qkv = qkv.view(b, s, self.groups_per_rank, g + 2, hd)
        q = qkv[:, :, :, :g].reshape(b, s, self.groups_per_rank * g, hd)
        k = qkv[:, :, :, g]
        v = qkv[:, :, :, g + 1]
        cos, sin = rotary_cos_sin(self.config, position_ids)
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        out = core_attention(q, k, v.contiguous(), segment_ids)
        return self.o_proj(out.reshape(b, s, -1))
