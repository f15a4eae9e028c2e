"""Rotary position embeddings (rotate-half convention, as HF weights expect) with LLaMA's scaling variants.

cos/sin are computed from the explicit positions once per micro batch and shared by every layer of a stage
(:mod:`llama_megatron.model.batch_cache`), so packed documents and pipeline stages see the same rotation.

'dynamic' (NTK) scaling depends on the longest position in the batch and is computed per call; unlike HF, which
keeps the largest length it has seen as state, the result here depends only on the batch itself.
"""

from __future__ import annotations

import math

import torch

from llama_megatron.config import ModelConfig
from llama_megatron.model.batch_cache import per_micro_batch
from llama_megatron.parallel.context_parallel import context_shard


def inverse_frequencies(config: ModelConfig, seq_len: int | None = None) -> torch.Tensor:
    """fp32 inverse frequencies for ``config``; ``seq_len`` matters only for 'dynamic' scaling."""
    dim = config.head_dim
    base = config.rope_theta
    scaling = config.rope_scaling or {}
    rope_type = config.rope_type
    if rope_type == "dynamic":
        original = scaling.get("original_max_position_embeddings", config.max_position_embeddings)
        if seq_len is not None and seq_len > original:
            factor = scaling["factor"]
            base = base * ((factor * seq_len / original) - (factor - 1)) ** (dim / (dim - 2))
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim))
    if rope_type == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif rope_type == "llama3":
        inv_freq = _llama3_scale(inv_freq, scaling)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_len / low
    high_freq_wavelen = old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


_inv_freq_on_device: dict[tuple, torch.Tensor] = {}


def _inverse_frequencies_on(config: ModelConfig, device: torch.device) -> torch.Tensor:
    """Cached per device: a host-to-device copy would wait for the device's queue (a sync per micro batch)."""
    key = (config.head_dim, config.rope_theta, repr(config.rope_scaling), device)
    if key not in _inv_freq_on_device:
        _inv_freq_on_device[key] = inverse_frequencies(config).to(device)
    return _inv_freq_on_device[key]


def _angles(inv_freq: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    freqs = positions.to(torch.float32).unsqueeze(-1) * inv_freq
    return torch.cat((freqs, freqs), dim=-1)


def _cos_sin(config: ModelConfig, position_ids: torch.Tensor, shard: int,
             shards: int) -> tuple[torch.Tensor, torch.Tensor]:
    if config.rope_type == "dynamic":
        # NTK scaling depends on the batch's longest position (of the whole sequence, also under context
        # parallelism): the one host sync, as in HF
        max_pos = int(position_ids.max()) + 1 if position_ids.numel() else 0
        inv_freq = inverse_frequencies(config, max_pos).to(position_ids.device)
    else:
        inv_freq = _inverse_frequencies_on(config, position_ids.device)
    angles = _angles(inv_freq, context_shard(position_ids, shard, shards, dim=-1))
    return angles.cos(), angles.sin()


def rotary_cos_sin(config: ModelConfig, position_ids: torch.Tensor, shard: int = 0,
                   shards: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos and sin of shape [*position_ids.shape, head_dim], computed once per micro batch; with ``shards``
    > 1 (context parallelism) those of contiguous sequence shard ``shard`` of the full-length ``position_ids``.

    Computed from the positions directly, as HF does (the same fp32 angle and cos/sin for every position), so
    no table bounds the positions and no device-to-host sync is needed except for 'dynamic' scaling.
    """
    rope = (config.rope_type, repr(config.rope_scaling), config.head_dim, config.rope_theta, shard, shards)
    return per_micro_batch(("rope", rope), (position_ids,), lambda: _cos_sin(config, position_ids, shard, shards))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` [batch, seq, heads, head_dim]; cos/sin [batch, seq, head_dim] (fp32, cast to x's dtype like HF)."""
    cos = cos.to(x.dtype).unsqueeze(2)
    sin = sin.to(x.dtype).unsqueeze(2)
    return x * cos + _rotate_half(x) * sin
