"""Deterministic initialisation that does not depend on the parallel layout.

Each full (HF-shaped) tensor is drawn from its own generator, seeded by the run seed and the tensor's HF name,
then sliced with the same code that converts HF checkpoints. So TP=4 x PP=2 gets exactly the weights that
TP=1 x PP=1 gets, sliced, and whole training runs can be compared across layouts.
The cost is drawing each full tensor once per rank (what Megatron's CPU initialisation does too).
"""

from __future__ import annotations

import hashlib

import torch
from torch import nn

from llama_megatron.checkpoint.hf_mapping import canonical_name, shard_for_rank
from llama_megatron.config import ModelConfig
from llama_megatron.parallel.context import ParallelContext


def _generator(seed: int, name: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


def hf_shape(name: str, config: ModelConfig) -> tuple[int, ...]:
    h, hd, ffn = config.hidden_size, config.head_dim, config.intermediate_size
    leaf = name.rsplit(".", 2)
    module, kind = leaf[-2], leaf[-1]
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return (config.vocab_size, h)
    if module.endswith("norm"):
        return (h,)
    out_in = {
        "q_proj": (config.num_attention_heads * hd, h),
        "k_proj": (config.num_key_value_heads * hd, h),
        "v_proj": (config.num_key_value_heads * hd, h),
        "o_proj": (h, config.num_attention_heads * hd),
        "gate_proj": (ffn, h),
        "up_proj": (ffn, h),
        "down_proj": (h, ffn),
    }[module]
    return out_in if kind == "weight" else out_in[:1]


def initial_hf_tensor(name: str, config: ModelConfig, seed: int) -> torch.Tensor:
    """The full fp32 tensor HF name ``name`` starts from: N(0, initializer_range) weights, zero biases, unit norms."""
    shape = hf_shape(name, config)
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    if name.endswith(".bias"):
        return torch.zeros(shape)
    return torch.normal(0.0, config.initializer_range, shape, generator=_generator(seed, name))


@torch.no_grad()
def initialize_weights(model: nn.Module, config: ModelConfig, pctx: ParallelContext, padded_vocab_size: int,
                       seed: int) -> None:
    """Fill every parameter of ``model`` (plain or pipeline form, any TP rank) from the seeded full tensors."""
    def get_hf(name: str) -> torch.Tensor:
        if name == "lm_head.weight" and config.tie_word_embeddings:
            name = "model.embed_tokens.weight"
        return initial_hf_tensor(name, config, seed)

    for name, param in model.named_parameters():
        canonical = canonical_name(name, config)
        shard = shard_for_rank(canonical, get_hf, config, pctx.tp_rank, pctx.tp_size, padded_vocab_size)
        param.copy_(shard.to(param.dtype))
