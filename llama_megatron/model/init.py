"""Deterministic initialisation that does not depend on the parallel layout.

Each full (HF-shaped) tensor is drawn from its own generator, seeded by the run seed and the tensor's HF name,
then sliced with the same code that converts HF checkpoints. So TP=4 x PP=2 gets exactly the weights that
TP=1 x PP=1 gets, sliced, and whole training runs can be compared across layouts.
The cost is drawing each full tensor once per rank (what Megatron's CPU initialisation does too).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable

import torch
from torch import nn

from llama_megatron.config import ModelConfig
from llama_megatron.model.param_layout import ParamLayout, ParamSpec
from llama_megatron.model.tp_slicing import shard_for_rank
from llama_megatron.parallel.context import ParallelContext
from llama_megatron.parallel.zero3 import copy_into


def _generator(seed: int, name: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


def initial_hf_tensor(name: str, shape: tuple[int, ...], init: str, std: float, seed: int) -> torch.Tensor:
    """The full fp32 HF tensor ``name`` starts from: N(0, std) weights (own generator), zero biases, unit norms;
    ``lora_a``: PEFT's LoRA A init, kaiming-uniform with a = sqrt(5) (own generator)."""
    if init == "ones":
        return torch.ones(shape)
    if init == "zeros":
        return torch.zeros(shape)
    if init == "lora_a":
        return nn.init.kaiming_uniform_(torch.empty(shape), a=math.sqrt(5), generator=_generator(seed, name))
    return torch.normal(0.0, std, shape, generator=_generator(seed, name))


@torch.no_grad()
def initialize_weights(model: nn.Module, config: ModelConfig, pctx: ParallelContext, padded_vocab_size: int,
                       seed: int) -> None:
    """Fill every parameter of ``model`` (plain or pipeline form, any TP rank) from the seeded full tensors."""
    initialize_parameters(model.named_parameters(), ParamLayout(config), config, pctx, padded_vocab_size, seed)


@torch.no_grad()
def initialize_parameters(named_parameters: Iterable[tuple[str, nn.Parameter]], layout: ParamLayout,
                          config: ModelConfig, pctx: ParallelContext, padded_vocab_size: int, seed: int) -> None:
    """Fill the named parameters (module naming) from the seeded full tensors of their rows in ``layout``."""
    for name, param in named_parameters:
        spec = layout.for_module(name)

        def get_hf(hf_name: str, spec: ParamSpec = spec) -> torch.Tensor:
            shape = spec.hf_shapes[spec.hf_names.index(hf_name)]
            return initial_hf_tensor(hf_name, shape, spec.init, config.initializer_range, seed)

        shard = shard_for_rank(spec, get_hf, config, pctx.tp_rank, pctx.tp_size, padded_vocab_size)
        copy_into(param, shard)  # under ZeRO-3's partitioned construction: this rank's slice only
