"""Multi-head latent attention (MLA: DeepSeek-V2/V3, transformers' ``DeepseekV3Attention``).

Each token's hidden state is projected down to two small latents: ``q_lora_rank`` for the queries (normalised,
then up-projected to every head's query; or one plain projection where ``q_lora_rank`` is null) and
``kv_lora_rank`` for keys and values (normalised, then up-projected to every head's unrotated key part and value),
beside one ``qk_rope_head_dim`` key part that every head shares. A head's query and key are
``[nope | rope]`` (``qk_nope_head_dim + qk_rope_head_dim``), its value ``v_head_dim``; RoPE rotates the rope parts
(rotate-half order: :mod:`llama_megatron.model.released_tensors` permutes released interleaved rows). Under YaRN
with ``mscale_all_dim`` the softmax scale is ``qk_head_dim ** -0.5`` times its mscale squared, applied to the queries
(the kernels scale by ``qk_head_dim ** -0.5``).

Tensor parallelism splits the heads: the up-projections' rows and ``o_proj``'s columns, as Megatron-core does. The
down-projections and their norms are replicated, and (Megatron-core's choice too) run where the hidden states are:
under SP on this rank's sequence shard, after which the latents, narrower than the hidden states, are all-gathered
once (``kv_lora_rank + qk_rope_head_dim + q_lora_rank`` values per token instead of ``hidden_size``); without SP
on the whole sequence on every TP rank. The gather's backward sums each rank's heads' gradients into the latents
(a reduce-scatter under SP, an all-reduce otherwise), so what lies before it receives whole gradients: under SP its
replicated weights' are each rank's tokens' share, summed over TP as an SP norm's are; without SP they are the same
on every rank. Context parallelism runs the attention through Ulysses as the grouped-query attention does, with each
head's whole key (its rope part copied to every head) and value.
"""

from __future__ import annotations

import torch
from torch import nn

from llama_megatron.config import ModelConfig
from llama_megatron.model.kernels import REFERENCE, Kernels
from llama_megatron.model.kv_cache import LayerKVCache
from llama_megatron.model.norm import RMSNorm
from llama_megatron.model.rope import apply_rotary, rotary_cos_sin, yarn_mscale
from llama_megatron.parallel.collectives import all_reduce_grad_in_tp
from llama_megatron.parallel.context import ParallelContext
from llama_megatron.parallel.context_parallel import UlyssesAttention
from llama_megatron.parallel.degrees import LocalShapes
from llama_megatron.parallel.layers import (
    LocalLinear,
    RowParallelLinear,
    column_parallel_input,
    mark_replicated,
)
from llama_megatron.parallel.weight_grad import WeightGradStore, linear

LATENT_NORM_EPS = 1e-6  # transformers builds the latents' RMSNorms with their default eps, not rms_norm_eps


class ReplicatedLinear(nn.Module):
    """``x W^T (+ b)`` with W whole on every TP rank, on the tokens this rank holds (its sequence shard under SP):
    under SP its gradient is this rank's tokens' share, summed over TP."""

    def __init__(self, in_features: int, out_features: int, pctx: ParallelContext, bias: bool = False) -> None:
        super().__init__()
        self.pctx = pctx
        self.weight = mark_replicated(nn.Parameter(torch.empty(out_features, in_features)))
        self.bias = mark_replicated(nn.Parameter(torch.zeros(out_features))) if bias else None
        self.partial_over_tp = pctx.sequence_parallel and pctx.tp_size > 1
        for param in (self.weight, self.bias):
            if param is not None and self.partial_over_tp:
                param.sequence_parallel = True
        self.lora: nn.Module | None = None
        self.weight_grad_store: WeightGradStore | None = None  # set for a zero-bubble schedule (weight_grad.py)
        self.float8 = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.weight, self.bias
        if self.partial_over_tp:
            weight = all_reduce_grad_in_tp(weight, self.pctx)
            bias = all_reduce_grad_in_tp(bias, self.pctx) if bias is not None else None
        y = linear(x, weight, bias, self.weight_grad_store, self.float8)
        return y if self.lora is None else y + self.lora(x)


def softmax_scale_factor(config: ModelConfig) -> float:
    """What the queries are multiplied by beyond the kernels' ``qk_head_dim ** -0.5``: YaRN's mscale of its factor
    at ``mscale_all_dim``, squared (transformers' ``yarn_apply_mscale``); 1 otherwise."""
    scaling = config.rope_scaling or {}
    all_dim = scaling.get("mscale_all_dim", 0)
    if config.rope_type == "default" or not all_dim:
        return 1.0
    return yarn_mscale(scaling["factor"], all_dim) ** 2


class LatentAttention(nn.Module):
    """MLA of one decoder layer (the module docstring): ``forward(hidden, position_ids, segment_ids, kv_cache)`` as
    :class:`~llama_megatron.model.attention.ParallelAttention`'s."""

    def __init__(self, config: ModelConfig, pctx: ParallelContext, shapes: LocalShapes,
                 kernels: Kernels = REFERENCE, layer: int = 0) -> None:
        super().__init__()
        self.config, self.pctx, self.kernels = config, pctx, kernels
        self.heads = shapes.heads
        h, bias = config.hidden_size, config.attention_bias
        self.nope, self.rope, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.q_rank, self.kv_rank = config.q_lora_rank, config.kv_lora_rank
        local_q = self.heads * config.qk_head_dim
        if self.q_rank is None:
            self.q_proj = LocalLinear(h, local_q, "column")
        else:
            self.q_a_proj = ReplicatedLinear(h, self.q_rank, pctx, bias)
            self.q_a_layernorm = RMSNorm(self.q_rank, LATENT_NORM_EPS, pctx, kernels)
            self.q_b_proj = LocalLinear(self.q_rank, local_q, "column")
        self.kv_a_proj_with_mqa = ReplicatedLinear(h, self.kv_rank + self.rope, pctx, bias)
        self.kv_a_layernorm = RMSNorm(self.kv_rank, LATENT_NORM_EPS, pctx, kernels)
        self.kv_b_proj = LocalLinear(self.kv_rank, self.heads * (self.nope + self.v_dim), "column")
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.v_dim, h, pctx, bias=config.o_bias)
        self.query_scale = softmax_scale_factor(config)
        self.attention = (kernels.attention if pctx.cp_size == 1 else UlyssesAttention(kernels.attention, pctx, 1))

    def forward(self, hidden: torch.Tensor, position_ids: torch.Tensor,
                segment_ids: torch.Tensor | None = None, kv_cache: LayerKVCache | None = None) -> torch.Tensor:
        """``kv_cache`` (generation): keys and values of the earlier positions, extended with this call's."""
        kv = self.kv_a_proj_with_mqa(hidden)
        latents = [self.kv_a_layernorm(kv[..., :self.kv_rank]), kv[..., self.kv_rank:]]
        if self.q_rank is None:
            latents.append(hidden)  # the queries' own projection splits its rows over TP: it needs every token too
        else:
            latents.append(self.q_a_layernorm(self.q_a_proj(hidden)))
        # one gather of every token's latents (SP), or their gradients summed over TP (module docstring)
        kv_latent, k_rot, q_input = column_parallel_input(torch.cat(latents, dim=-1), self.pctx).split(
            [self.kv_rank, self.rope, latents[2].shape[-1]], dim=-1)
        b, s = kv_latent.shape[:2]
        q = (self.q_proj(q_input) if self.q_rank is None else self.q_b_proj(q_input)).view(b, s, self.heads, -1)
        kv_b = self.kv_b_proj(kv_latent).view(b, s, self.heads, self.nope + self.v_dim)
        k_nope, v = kv_b.split([self.nope, self.v_dim], dim=-1)
        cos, sin = rotary_cos_sin(self.config, position_ids, self.pctx.cp_rank, self.pctx.cp_size)
        q_rot = apply_rotary(q[..., self.nope:], cos, sin)
        k_rot = apply_rotary(k_rot.unsqueeze(2), cos, sin)
        q = torch.cat([q[..., :self.nope], q_rot], dim=-1)
        if self.query_scale != 1.0:
            q = q * self.query_scale
        if kv_cache is not None:  # the latent cache: every earlier position's latent, its heads expanded anew
            latent = torch.cat([kv_latent.unsqueeze(2), k_rot], dim=-1)
            cached, _, first_key = kv_cache.append(latent, latent.new_empty(b, s, 1, 0))
            k_rot = cached[..., self.kv_rank:]
            k_nope, v = self.kv_b_proj(cached[:, :, 0, :self.kv_rank]).view(
                b, cached.shape[1], self.heads, self.nope + self.v_dim).split([self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_rot.expand(*k_nope.shape[:3], self.rope)], dim=-1)
        v = v.contiguous()
        if kv_cache is not None:
            out = self.kernels.attention.after(q, k, v, None, None, first_key)
        else:
            attend = self.attention if self.pctx.cp_size > 1 else self.kernels.attention
            out = attend(q, k, v, segment_ids, None)
        return self.o_proj(out.reshape(b, s, -1))
