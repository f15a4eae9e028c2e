"""Rotary position embeddings (rotate-half convention, as HF weights expect) with LLaMA's scaling variants and YaRN
(Qwen2.5's long context, DeepSeek-V3's: interpolated frequencies, cos and sin scaled by its attention factor).

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
    elif rope_type == "yarn":
        inv_freq = _yarn_frequencies(dim, base, scaling)
    return inv_freq


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction of a context ``scale``: 1 + 0.1 x mscale x ln(scale) (1 where not extended)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def attention_factor(config: ModelConfig) -> float:
    """What cos and sin are multiplied by (transformers' ``attention_scaling``): YaRN's ``attention_factor``, or
    its mscale ratio, or its mscale of the factor; 1 for every other rope type."""
    if config.rope_type != "yarn":
        return 1.0
    scaling = config.rope_scaling
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    mscale, all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and all_dim:
        return yarn_mscale(scaling["factor"], mscale) / yarn_mscale(scaling["factor"], all_dim)
    return yarn_mscale(scaling["factor"])


def _yarn_frequencies(dim: int, base: float, scaling: dict) -> torch.Tensor:
    """YaRN (transformers' ``_compute_yarn_parameters``): each frequency between its extrapolated value (kept) and
    its interpolated one (divided by ``factor``), by a linear ramp over the dimensions whose wavelengths fall between
    ``beta_fast`` and ``beta_slow`` rotations of the original context."""
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolated = 1 - ramp
    wavelengths = base ** (torch.arange(0, dim, 2).to(torch.float32) / dim)  # transformers' order of operations
    return 1.0 / (factor * wavelengths) * (1 - extrapolated) + 1.0 / wavelengths * extrapolated


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
    scale = attention_factor(config)
    if scale != 1.0:
        return angles.cos() * scale, angles.sin() * scale
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
