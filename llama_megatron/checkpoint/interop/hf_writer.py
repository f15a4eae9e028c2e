"""Write a Hugging Face LLaMA directory from any tensor source, one tensor at a time.

Output: ``config.json`` (from the model config), sharded safetensors in ``save_pretrained``'s naming with
``model.safetensors.index.json``, ``generation_config.json`` and tokenizer files copied from ``assets_dir``.
The vocabulary is the true one (sources hand out unpadded tensors); with tied embeddings no ``lm_head.weight``
is written, as transformers does.
"""

from __future__ import annotations

import json
import os

import torch

from llama_megatron.checkpoint.interop.hf_reader import TOKENIZER_FILES, copy_assets
from llama_megatron.checkpoint.interop.safetensors_stream import SafetensorsShardWriter
from llama_megatron.checkpoint.sources import TensorSource
from llama_megatron.config import ModelConfig
from llama_megatron.model.param_layout import ParamLayout
from llama_megatron.progress import TaskProgress

DTYPE_NAMES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_HF_DTYPE_NAME = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def hf_config_dict(config: ModelConfig, dtype: torch.dtype) -> dict:
    out = config.to_hf_dict()
    out["torch_dtype"] = _HF_DTYPE_NAME.get(dtype, str(dtype).removeprefix("torch."))
    return out


def generation_config_dict(config: ModelConfig) -> dict:
    out = {"_from_model_config": True}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(config, key) is not None:
            out[key] = getattr(config, key)
    return out


def _write_json(path: str, data: dict) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=2, sort_keys=True)
        fh.write("\n")


def write_hf_directory(source: TensorSource, config: ModelConfig, out_dir: str, dtype: torch.dtype,
                       assets_dir: str | None = None, max_shard_bytes: int = 5 * 2**30,
                       progress: TaskProgress | None = None) -> list[str]:
    """Fill ``out_dir``; returns the tokenizer/generation files copied from ``assets_dir``."""
    layout = ParamLayout(config)
    plan = [(name, shape, dtype) for name, shape in layout.hf_shapes().items()]
    writer = SafetensorsShardWriter(out_dir, plan, max_shard_bytes)
    for spec in layout:
        for name in spec.hf_names:
            writer.write(name, *source.get_parts(name))
        source.release()  # one parameter's pages at a time
        if progress:
            progress.advance(1, sum(torch.Size(s).numel() for s in spec.hf_shapes) * dtype.itemsize)
    writer.close()
    _write_json(os.path.join(out_dir, "config.json"), hf_config_dict(config, dtype))
    copied = copy_assets(assets_dir, out_dir, ("generation_config.json", *TOKENIZER_FILES)) if assets_dir else []
    if "generation_config.json" not in copied:
        _write_json(os.path.join(out_dir, "generation_config.json"), generation_config_dict(config))
    return copied
