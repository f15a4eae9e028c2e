"""How each parameter splits over TP: bit-exact slicing of full HF tensors into per-rank tensors, and back.

Everything works one parameter at a time: :func:`shard_parts` pulls the HF tensors it needs through a getter
(a dict, a lazily opened safetensors file, or the seeded initialiser) and returns this rank's tensor as views
of them, so the streaming converters never materialise a padded vocabulary, fused QKV or fused gate/up tensor,
and initialisation reuses the exact same slicing. Only row-parallel slices (a column block) and vocabulary
padding (zeros) allocate, at 1/TP of the tensor.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from llama_megatron.config import ModelConfig
from llama_megatron.model.param_layout import ParamLayout, ParamSpec
from llama_megatron.parallel.degrees import LocalShapes

HFGetter = Callable[[str], torch.Tensor]


def shard_parts(spec: ParamSpec, get_hf: HFGetter, config: ModelConfig, tp_rank: int, tp_size: int,
                padded_vocab_size: int) -> list[torch.Tensor]:
    """This rank's tensor for ``spec`` as a list of views of the full HF tensors (``torch.cat`` them)."""
    kind = spec.split
    sources = [get_hf(name) for name in spec.hf_names]
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
        groups = LocalShapes.of(config, tp_size).kv_heads
        parts = []
        for j in range(tp_rank * groups, (tp_rank + 1) * groups):
            parts += [q[j * g * hd:(j + 1) * g * hd], k[j * hd:(j + 1) * hd], v[j * hd:(j + 1) * hd]]
        return parts
    if kind == "gate_up":
        gate, up = sources
        return [gate.chunk(tp_size, dim=0)[tp_rank], up.chunk(tp_size, dim=0)[tp_rank]]
    if kind == "row":
        return [sources[0].chunk(tp_size, dim=1)[tp_rank]]
    if kind == "column":
        return [sources[0].chunk(tp_size, dim=0)[tp_rank]]
    return [sources[0]]


def shard_shape(spec: ParamSpec, config: ModelConfig, tp_size: int, padded_vocab_size: int) -> tuple[int, ...]:
    """Shape of ``shard_for_rank(...)`` without data (tested against it)."""
    kind = spec.split
    first = spec.hf_shapes[0]
    rest = tuple(first[1:])
    if kind == "vocab":
        return (padded_vocab_size // tp_size, *rest)
    if kind == "qkv":
        groups = LocalShapes.of(config, tp_size).kv_heads
        return (groups * (config.queries_per_group + 2) * config.head_dim, *rest)
    if kind == "gate_up":
        return (2 * first[0] // tp_size, *rest)
    if kind == "row":
        return (first[0], first[1] // tp_size)
    if kind == "column":
        return (first[0] // tp_size, *rest)
    return tuple(first)


def merge_parts(spec: ParamSpec, shards: list[torch.Tensor], config: ModelConfig) -> dict[str, list[torch.Tensor]]:
    """Inverse of :func:`shard_parts`: each HF tensor as row slices of the TP shards. Only row-parallel tensors
    with TP > 1 need a copy."""
    kind = spec.split
    names = spec.hf_names
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
        groups = LocalShapes.of(config, tp_size).kv_heads
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
    if kind == "column":
        return {names[0]: list(shards)}
    return {names[0]: [shards[0]]}


def shard_for_rank(spec: ParamSpec, get_hf: HFGetter, config: ModelConfig, tp_rank: int, tp_size: int,
                   padded_vocab_size: int) -> torch.Tensor:
    """This rank's tensor for ``spec``, built from full HF tensors (bit-exact slicing, no arithmetic)."""
    return torch.cat(shard_parts(spec, get_hf, config, tp_rank, tp_size, padded_vocab_size))


def merge_shards(spec: ParamSpec, shards: list[torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Inverse of :func:`shard_for_rank`: the TP shards (in rank order) -> full HF tensors by name."""
    return {name: torch.cat(parts) for name, parts in merge_parts(spec, shards, config).items()}


def hf_to_rank_state_dict(hf_state: dict[str, torch.Tensor], config: ModelConfig, tp_rank: int, tp_size: int,
                          padded_vocab_size: int, ep_rank: int = 0, ep_size: int = 1) -> dict[str, torch.Tensor]:
    """A full HF state dict -> one TP (and expert-parallel) rank's state dict in module naming (all layers)."""
    def get_hf(name: str) -> torch.Tensor:
        if name == "lm_head.weight" and name not in hf_state and config.tie_word_embeddings:
            name = "model.embed_tokens.weight"
        try:
            return hf_state[name]
        except KeyError:
            raise KeyError(f"HF state dict has no tensor {name}") from None

    return {spec.module_name: shard_for_rank(spec, get_hf, config, tp_rank, tp_size, padded_vocab_size)
            for spec in ParamLayout(config).held_by(ep_rank, ep_size)}


def rank_state_dicts_to_hf(rank_states: list[dict[str, torch.Tensor]], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Every TP rank's state dict (module naming, rank order) -> a full HF state dict."""
    out: dict[str, torch.Tensor] = {}
    for spec in ParamLayout(config):
        out.update(merge_shards(spec, [state[spec.module_name] for state in rank_states], config))
    if config.tie_word_embeddings:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out
