"""Keys and values of earlier positions, per decoder layer, for incremental decoding (generation).

Preallocated for the longest sequence the caller will decode, so each step writes in place instead of
concatenating; every layer's entry holds this TP rank's KV heads.
"""

from __future__ import annotations

import torch


class LayerKVCache:
    def __init__(self, batch: int, max_len: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.keys = torch.empty(batch, max_len, kv_heads, head_dim, dtype=dtype, device=device)
        self.values = torch.empty_like(self.keys)
        self.length = 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k``/``v`` [b, s, kv_heads, d] after the cached positions; all keys and values so far."""
        end = self.length + k.shape[1]
        if end > self.keys.shape[1]:
            raise ValueError(f"KV cache holds {self.keys.shape[1]} positions, {end} asked")
        self.keys[:, self.length:end] = k
        self.values[:, self.length:end] = v
        self.length = end
        return self.keys[:, :end], self.values[:, :end]


class KVCache:
    """One :class:`LayerKVCache` per decoder layer of the model (in layer order)."""

    def __init__(self, num_layers: int, batch: int, max_len: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.layers = [LayerKVCache(batch, max_len, kv_heads, head_dim, dtype, device) for _ in range(num_layers)]

    @property
    def length(self) -> int:
        return self.layers[0].length if self.layers else 0
