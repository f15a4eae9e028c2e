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


def layer_file(ckpt_dir: str, layer_idx: int, tp_rank: int) -> str:
    return os.path.join(ckpt_dir, f"layer_{layer_idx:02d}-model_{tp_rank:02d}-model_states.pt")


def model_states_file(ckpt_dir: str, mp_rank: int) -> str:
    return os.path.join(ckpt_dir, f"mp_rank_{mp_rank:02d}_model_states.pt")


def expert_file(ckpt_dir: str, layer_idx: int, expert: int, tp_rank: int) -> str:
    """Not ``layer_...``: DeepSpeed's pipeline loader reads every ``layer_{idx:02d}-*model_states.pt`` as the layer's."""
    return os.path.join(ckpt_dir, f"expert_{expert:03d}-layer_{layer_idx:02d}-model_{tp_rank:02d}-model_states.pt")


def is_pipeline_checkpoint(ckpt_dir: str) -> bool:
    return os.path.isfile(layer_file(ckpt_dir, 0, 0))
