"""One TP rank's tensor as a list of views of the full HF tensors, for streaming writers.

``hf_mapping.shard_for_rank`` is ``torch.cat(shard_parts(...))``; the converters write the parts directly, so no padded
vocabulary, fused QKV or fused gate/up tensor is ever materialised: the parts are row slices of the (memory-mapped)
HF tensors, so converting costs one tensor's pages, not two or three copies of it. Only row-parallel slices
(o_proj, down_proj: a column block) and vocabulary padding (zeros) allocate, at 1/TP of the tensor.
"""

from __future__ import annotations

import torch

from llama_megatron.checkpoint.hf_mapping import HFGetter, hf_sources, split_kind
from llama_megatron.config import ModelConfig


def shard_parts(canonical: str, get_hf: HFGetter, config: ModelConfig, tp_rank: int, tp_size: int,
                padded_vocab_size: int) -> list[torch.Tensor]:
    kind = split_kind(canonical)
    sources = [get_hf(name) for name in hf_sources(canonical, config)]
    if kind == "vocab":
        full = sources[0]
        rows = padded_vocab_size // tp_size
        start, end = tp_rank * rows, (tp_rank + 1) * rows
        real_end = min(end, full.shape[0])
        parts = [full[start:real_end]] if real_end > start else []
        padding = end - max(start, real_end)
        if padding:
            parts.append(full.new_zeros((padding, *full.shape[1:])))
        return parts
    if kind == "qkv":
        q, k, v = sources
        hd, g = config.head_dim, config.queries_per_group
        groups = config.num_key_value_heads // tp_size
        parts = []
        for j in range(tp_rank * groups, (tp_rank + 1) * groups):
            parts += [q[j * g * hd:(j + 1) * g * hd], k[j * hd:(j + 1) * hd], v[j * hd:(j + 1) * hd]]
        return parts
    if kind == "gate_up":
        gate, up = sources
        return [gate.chunk(tp_size, dim=0)[tp_rank], up.chunk(tp_size, dim=0)[tp_rank]]
    if kind == "row":
        return [sources[0].chunk(tp_size, dim=1)[tp_rank]]
    return [sources[0]]


def shard_shape(canonical: str, config: ModelConfig, tp_rank: int, tp_size: int,
                padded_vocab_size: int, hf_shapes: dict[str, tuple[int, ...]]) -> tuple[int, ...]:
    """Shape of ``shard_for_rank(...)`` without data (tested against it; meta tensors would import ~70 MB)."""
    kind = split_kind(canonical)
    first = hf_shapes[hf_sources(canonical, config)[0]]
    rest = tuple(first[1:])
    if kind == "vocab":
        return (padded_vocab_size // tp_size, *rest)
    if kind == "qkv":
        groups = config.num_key_value_heads // tp_size
        return (groups * (config.queries_per_group + 2) * config.head_dim, *rest)
    if kind == "gate_up":
        return (2 * first[0] // tp_size, *rest)
    if kind == "row":
        return (first[0], first[1] // tp_size)
    return tuple(first)


def merge_parts(canonical: str, shards: list[torch.Tensor], config: ModelConfig) -> dict[str, list[torch.Tensor]]:
    """Inverse of :func:`shard_parts`: each HF tensor as row slices of the TP shards (``torch.cat`` of them
    equals ``hf_mapping.merge_shards``, tested). Only row-parallel tensors with TP > 1 need a copy."""
    kind = split_kind(canonical)
    names = hf_sources(canonical, config)
    tp_size = len(shards)
    if kind == "vocab":
        parts, remaining = [], config.vocab_size
        for shard in shards:
            if remaining > 0:
                parts.append(shard[:remaining])
                remaining -= parts[-1].shape[0]
        return {names[0]: parts}
    if kind == "qkv":
        hd, g = config.head_dim, config.queries_per_group
        groups = config.num_key_value_heads // tp_size
        out: dict[str, list[torch.Tensor]] = {name: [] for name in names}
        for shard in shards:
            for j in range(groups):
                base = j * (g + 2) * hd
                out[names[0]].append(shard[base:base + g * hd])
                out[names[1]].append(shard[base + g * hd:base + (g + 1) * hd])
                out[names[2]].append(shard[base + (g + 1) * hd:base + (g + 2) * hd])
        return out
    if kind == "gate_up":
        halves = [shard.chunk(2, dim=0) for shard in shards]
        return {names[0]: [h[0] for h in halves], names[1]: [h[1] for h in halves]}
    if kind == "row":
        return {names[0]: [shards[0] if tp_size == 1 else torch.cat(shards, dim=1)]}
    return {names[0]: [shards[0]]}
