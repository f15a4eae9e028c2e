"""Tiny configs and HF twins shared by the model tests."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from llama_megatron.config import ModelConfig

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}


def tiny_config(**overrides) -> ModelConfig:
    base = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
                num_key_value_heads=8, max_position_embeddings=64, rms_norm_eps=1e-5)
    base.update(overrides)
    return ModelConfig(**base)


def hf_model(config: ModelConfig, seed: int = 0) -> LlamaForCausalLM:
    """A random HF LLaMA with non-trivial norms and biases, identical in every process for the same seed."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**config.to_hf_dict(), attn_implementation="sdpa")).float()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                param.copy_(1.0 + 0.1 * torch.randn_like(param) if "norm" in name else 0.1 * torch.randn_like(param))
    return model
