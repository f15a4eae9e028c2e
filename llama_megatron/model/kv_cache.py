"""Keys and values of earlier positions, per decoder layer, for incremental decoding (generation).

Preallocated for the longest sequence the caller will decode, so each step writes in place instead of
concatenating; every layer's entry holds this TP rank's KV heads. A chunked-attention layer (Llama 4: a query sees
the keys of its own chunk up to itself) holds one chunk: no later query sees an earlier chunk's keys, so a step
that starts a chunk starts the layer's cache anew, and its memory is the chunk's, not the sequence's.

Multi-head latent attention (DeepSeek-V3) caches its latent instead: per position one ``kv_lora_rank`` latent and the
rotated key part every head shares (``value_dim`` 0), from which each step expands the heads' keys and values
(:meth:`~llama_megatron.config.ModelConfig.kv_cache_widths`).
"""

from __future__ import annotations

import torch


class LayerKVCache:
    def __init__(self, batch: int, max_len: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, chunk: int | None = None, value_dim: int | None = None) -> None:
        self.chunk = chunk if chunk is not None and chunk < max_len else None
        self.max_len = max_len
        size = max_len if self.chunk is None else self.chunk
        self.keys = torch.empty(batch, size, kv_heads, head_dim, dtype=dtype, device=device)
        value_dim = head_dim if value_dim is None else value_dim
        self.values = torch.empty(batch, size, kv_heads, value_dim, dtype=dtype, device=device)
        self.length = 0  # positions seen

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Store ``k``/``v`` [b, s, kv_heads, d] of the next positions; the keys and values the call's queries may
        see (every position so far; in a chunked layer those from the start of the first query's chunk) and the
        position of the first of them."""
        end = self.length + k.shape[1]
        if end > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} positions, {end} asked")
        if self.chunk is None:
            self.keys[:, self.length:end] = k
            self.values[:, self.length:end] = v
            self.length = end
            return self.keys[:, :end], self.values[:, :end], 0
        # held: the chunk of position length - 1, from its start; the first query's chunk starts at `first`, that
        # chunk's start (held keys[:, :kept]) or `length` (a new chunk: nothing held is seen again, kept = 0)
        first = self.length // self.chunk * self.chunk
        kept = self.length - first
        if end - first <= self.chunk:  # the call stays in that chunk: in place
            self.keys[:, kept:kept + k.shape[1]] = k
            self.values[:, kept:kept + k.shape[1]] = v
            self.length = end
            return self.keys[:, :end - first], self.values[:, :end - first], first
        # a call across chunks (a prompt): everything it sees, then the last position's chunk held
        keys, values = torch.cat([self.keys[:, :kept], k], dim=1), torch.cat([self.values[:, :kept], v], dim=1)
        last = (end - 1) // self.chunk * self.chunk
        self.keys[:, :end - last] = keys[:, last - first:]
        self.values[:, :end - last] = values[:, last - first:]
        self.length = end
        return keys, values, first


class KVCache:
    """One :class:`LayerKVCache` per decoder layer of the model (in layer order); ``chunks``: each layer's attention
    chunk (None where it attends to every earlier position); ``value_dim``: the values' width where not the keys'."""

    def __init__(self, num_layers: int, batch: int, max_len: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, chunks: list[int | None] | None = None,
                 value_dim: int | None = None) -> None:
        chunks = chunks or [None] * num_layers
        self.layers = [LayerKVCache(batch, max_len, kv_heads, head_dim, dtype, device, chunk, value_dim)
                       for chunk in chunks]

    @property
    def length(self) -> int:
        return self.layers[0].length if self.layers else 0

    def held_bytes(self) -> int:
        """Bytes of the keys and values every layer holds allocated."""
        return sum((layer.keys.numel() + layer.values.numel()) * layer.keys.element_size() for layer in self.layers)
