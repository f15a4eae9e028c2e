"""Bit-exact mapping between Hugging Face LLaMA tensors and this model's per-TP-rank tensors.

Everything works one parameter at a time: ``shard_for_rank`` pulls the HF tensors it needs through a getter
(a dict, a lazily opened safetensors file, or the seeded initialiser), so converters can stream and
initialisation can reuse the exact same slicing. Parameters are named as the model registers them
(PipelineModule naming: ``"<layer index>.<path>"`` or ``"tied_modules.embed.<path>"``); ``canonical_name`` turns
that into a layout-free key (``"layers.3.self_attn.qkv_proj.weight"``).
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

from llama_megatron.config import ModelConfig

HFGetter = Callable[[str], torch.Tensor]

_DECODER_PARAMS = (
    "input_layernorm.weight",
    "self_attn.qkv_proj.weight",
    "self_attn.qkv_proj.bias",
    "self_attn.o_proj.weight",
    "self_attn.o_proj.bias",
    "post_attention_layernorm.weight",
    "mlp.gate_up_proj.weight",
    "mlp.gate_up_proj.bias",
    "mlp.down_proj.weight",
    "mlp.down_proj.bias",
)


def canonical_name(module_name: str, config: ModelConfig) -> str:
    """Module parameter name (PipelineModule or LlamaCausalLM) -> layout-free canonical name."""
    n_layers = config.num_hidden_layers
    if module_name.startswith("tied_modules.embed."):
        return "embed.weight"
    match = re.fullmatch(r"(\d+)\.(.+)", module_name)
    if not match:
        raise KeyError(f"not a model parameter name: {module_name}")
    idx, rest = int(match.group(1)), match.group(2)
    if idx == 0 and rest == "word_embeddings.weight":
        return "embed.weight"
    if 1 <= idx <= n_layers:
        return f"layers.{idx - 1}.{rest}"
    if idx == n_layers + 1 and rest == "norm.weight":
        return "norm.weight"
    if idx == n_layers + 2 and rest == "lm_head.weight":
        return "lm_head.weight"
    raise KeyError(f"not a model parameter name: {module_name}")


def module_name(canonical: str, config: ModelConfig) -> str:
    """Inverse of :func:`canonical_name`."""
    n_layers = config.num_hidden_layers
    if canonical == "embed.weight":
        return "tied_modules.embed.word_embeddings.weight" if config.tie_word_embeddings else "0.word_embeddings.weight"
    if canonical == "norm.weight":
        return f"{n_layers + 1}.norm.weight"
    if canonical == "lm_head.weight":
        return f"{n_layers + 2}.lm_head.weight"
    match = re.fullmatch(r"layers\.(\d+)\.(.+)", canonical)
    if not match:
        raise KeyError(f"not a canonical parameter name: {canonical}")
    return f"{int(match.group(1)) + 1}.{match.group(2)}"


def canonical_names(config: ModelConfig) -> list[str]:
    """Every parameter of the model, in layer order."""
    names = ["embed.weight"]
    for layer in range(config.num_hidden_layers):
        for param in _DECODER_PARAMS:
            if param.endswith(".bias"):
                has_bias = config.attention_bias if "self_attn" in param else config.mlp_bias
                if not has_bias:
                    continue
            names.append(f"layers.{layer}.{param}")
    names.append("norm.weight")
    if not config.tie_word_embeddings:
        names.append("lm_head.weight")
    return names


def layer_index(canonical: str, config: ModelConfig) -> list[int]:
    """Pipeline layer indices that hold ``canonical`` (two for a tied embedding)."""
    n_layers = config.num_hidden_layers
    if canonical == "embed.weight":
        return [0, n_layers + 2] if config.tie_word_embeddings else [0]
    if canonical == "norm.weight":
        return [n_layers + 1]
    if canonical == "lm_head.weight":
        return [n_layers + 2]
    return [int(canonical.split(".")[1]) + 1]


def hf_sources(canonical: str, config: ModelConfig) -> list[str]:
    """The HF tensor names that make up ``canonical``."""
    if canonical == "embed.weight":
        return ["model.embed_tokens.weight"]
    if canonical == "norm.weight":
        return ["model.norm.weight"]
    if canonical == "lm_head.weight":
        return ["lm_head.weight"]
    _, layer, module, leaf = canonical.split(".", 3)
    prefix = f"model.layers.{layer}"
    kind = leaf.split(".")[-1]
    if module == "self_attn" and leaf.startswith("qkv_proj"):
        return [f"{prefix}.self_attn.{p}_proj.{kind}" for p in "qkv"]
    if module == "mlp" and leaf.startswith("gate_up_proj"):
        return [f"{prefix}.mlp.gate_proj.{kind}", f"{prefix}.mlp.up_proj.{kind}"]
    return [f"{prefix}.{module}.{leaf}"]


def split_kind(canonical: str) -> str:
    """How a parameter is split over TP: 'vocab', 'qkv', 'gate_up', 'row', or 'replicated'."""
    if canonical in ("embed.weight", "lm_head.weight"):
        return "vocab"
    if "qkv_proj" in canonical:
        return "qkv"
    if "gate_up_proj" in canonical:
        return "gate_up"
    if canonical.endswith(("o_proj.weight", "down_proj.weight")):
        return "row"
    return "replicated"


def shard_for_rank(canonical: str, get_hf: HFGetter, config: ModelConfig, tp_rank: int, tp_size: int,
                   padded_vocab_size: int) -> torch.Tensor:
    """This rank's tensor for ``canonical``, built from full HF tensors (bit-exact slicing, no arithmetic)."""
    # The slicing lives once, in tp_parts (as views, for the streaming converters); imported here because
    # tp_parts itself builds on this module's names.
    from llama_megatron.checkpoint.tp_parts import shard_parts

    return torch.cat(shard_parts(canonical, get_hf, config, tp_rank, tp_size, padded_vocab_size))


def merge_shards(canonical: str, shards: list[torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Inverse of :func:`shard_for_rank`: the TP shards (in rank order) -> full HF tensors by name."""
    from llama_megatron.checkpoint.tp_parts import merge_parts

    return {name: torch.cat(parts) for name, parts in merge_parts(canonical, shards, config).items()}


def hf_to_rank_state_dict(hf_state: dict[str, torch.Tensor], config: ModelConfig, tp_rank: int, tp_size: int,
                          padded_vocab_size: int) -> dict[str, torch.Tensor]:
    """A full HF state dict -> one TP rank's state dict in module naming (all layers)."""
    def get_hf(name: str) -> torch.Tensor:
        if name == "lm_head.weight" and name not in hf_state and config.tie_word_embeddings:
            name = "model.embed_tokens.weight"
        try:
            return hf_state[name]
        except KeyError:
            raise KeyError(f"HF state dict has no tensor {name}") from None

    return {
        module_name(c, config): shard_for_rank(c, get_hf, config, tp_rank, tp_size, padded_vocab_size)
        for c in canonical_names(config)
    }


def rank_state_dicts_to_hf(rank_states: list[dict[str, torch.Tensor]], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Every TP rank's state dict (module naming, rank order) -> a full HF state dict."""
    out: dict[str, torch.Tensor] = {}
    for c in canonical_names(config):
        name = module_name(c, config)
        out.update(merge_shards(c, [state[name] for state in rank_states], config))
    if config.tie_word_embeddings:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out
