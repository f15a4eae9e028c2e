"""Rotary position embeddings (rotate-half convention, as HF weights expect) with LLaMA's scaling variants.

cos/sin tables are precomputed once per process for positions below ``max_position_embeddings`` and shared by
every layer (a per-layer table would cost layers x positions x head_dim floats); positions are always explicit,
so packed documents and pipeline stages see the same rotation.

'dynamic' (NTK) scaling depends on the longest position in the batch and is computed per call; unlike HF, which
keeps the largest length it has seen as state, the result here depends only on the batch itself.
"""

from __future__ import annotations

import functools
import math

import torch

from llama_megatron.config import ModelConfig


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


def _angles(inv_freq: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    freqs = positions.to(torch.float32).unsqueeze(-1) * inv_freq
    return torch.cat((freqs, freqs), dim=-1)


@functools.lru_cache(maxsize=8)
def _cos_sin_table(inv_freq: tuple[float, ...], length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    angles = _angles(torch.tensor(inv_freq, dtype=torch.float32, device=device), torch.arange(length, device=device))
    return angles.cos(), angles.sin()


def rotary_cos_sin(config: ModelConfig, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos and sin of shape [*position_ids.shape, head_dim]."""
    max_pos = int(position_ids.max()) + 1 if position_ids.numel() else 0
    if config.rope_type == "dynamic" or max_pos > config.max_position_embeddings:
        angles = _angles(inverse_frequencies(config, max_pos).to(position_ids.device), position_ids)
        return angles.cos(), angles.sin()
    inv_freq = tuple(inverse_frequencies(config).tolist())
    cos, sin = _cos_sin_table(inv_freq, config.max_position_embeddings, position_ids.device)
    return cos[position_ids], sin[position_ids]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` [batch, seq, heads, head_dim]; cos/sin [batch, seq, head_dim] (fp32, cast to x's dtype like HF)."""
    cos = cos.to(x.dtype).unsqueeze(2)
    sin = sin.to(x.dtype).unsqueeze(2)
    return x * cos + _rotate_half(x) * sin
