"""Read model weights out of DeepSpeed-format checkpoint files, for any pipeline layout of the reader.

Two layouts exist, both written by DeepSpeed (and by our converter, which mimics them):

- pipeline checkpoints: ``layer_{idx:02d}-model_{tp:02d}-model_states.pt``, one per layer index and TP rank,
  keys relative to the layer (``input_layernorm.weight``); a tied embedding lives in layer 0's file;
- plain (PP=1) checkpoints: ``mp_rank_{tp:02d}_model_states.pt`` whose ``module`` entry is the whole state dict
  in module naming (``3.self_attn.qkv_proj.weight``).

An expert-parallel run (``expert`` > 1 in ``llama_megatron.json``) keeps its experts out of those files: each EP rank
holds other experts, and DeepSpeed writes the layer/module files from data-parallel rank 0 only. Every expert of every
layer has a file of its own per TP rank, ``expert_{e:03d}-layer_{idx:02d}-model_{tp:02d}-model_states.pt``, keys as in
a layer file (``mlp.experts.5.down_proj.weight``), whichever layout wrote it; so any EP degree reads it.

Because parameters are addressed by (canonical name, TP rank), a checkpoint saved with PP=2 loads into a PP=1
or PP=4 model with the same TP. Files are read weights-only (:mod:`llama_megatron.checkpoint.safe_load`).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from llama_megatron.checkpoint.safe_load import load_state_file
from llama_megatron.errors import CheckpointError
from llama_megatron.model.param_layout import ParamSpec


def layer_file(ckpt_dir: str, layer_idx: int, tp_rank: int) -> str:
    return os.path.join(ckpt_dir, f"layer_{layer_idx:02d}-model_{tp_rank:02d}-model_states.pt")


def model_states_file(ckpt_dir: str, mp_rank: int) -> str:
    return os.path.join(ckpt_dir, f"mp_rank_{mp_rank:02d}_model_states.pt")


def expert_file(ckpt_dir: str, layer_idx: int, expert: int, tp_rank: int) -> str:
    """Not ``layer_...``: DeepSpeed's pipeline loader reads every ``layer_{idx:02d}-*model_states.pt`` as the layer's."""
    return os.path.join(ckpt_dir, f"expert_{expert:03d}-layer_{layer_idx:02d}-model_{tp_rank:02d}-model_states.pt")


def is_pipeline_checkpoint(ckpt_dir: str) -> bool:
    return os.path.isfile(layer_file(ckpt_dir, 0, 0))


def tensor_reader(ckpt_dir: str) -> Callable[[ParamSpec, int], torch.Tensor]:
    """``read(spec, tp_rank)`` -> that rank's tensor; caches one file at a time (streams layer by layer)."""
    pipeline = is_pipeline_checkpoint(ckpt_dir)
    cache: dict[str, dict] = {}

    def cached(path: str) -> dict:
        if path not in cache:
            cache.clear()
            cache[path] = load_state_file(path)
        return cache[path]

    def read(spec: ParamSpec, tp_rank: int) -> torch.Tensor:
        if pipeline:
            key = spec.layer_key
            state = cached(layer_file(ckpt_dir, spec.layers[0], tp_rank))
        else:
            key = spec.module_name
            state = cached(model_states_file(ckpt_dir, tp_rank)).get("module") or {}
        if key not in state:
            raise CheckpointError(f"{ckpt_dir}: no tensor {key!r} for TP rank {tp_rank} ({spec.name})")
        tensor = state[key]
        if tensor.numel() == 0:
            raise CheckpointError(f"{ckpt_dir}: {key!r} is empty (a ZeRO-3 partition); export the checkpoint instead")
        return tensor

    return read
