"""Write a Hugging Face LLaMA directory from any tensor source, one tensor at a time.

Output: ``config.json`` (from the model config), sharded safetensors in ``save_pretrained``'s naming with
``model.safetensors.index.json``, ``generation_config.json`` and tokenizer files copied from ``assets_dir``.
The vocabulary is the true one (sources hand out unpadded tensors); with tied embeddings no ``lm_head.weight``
is written, as transformers does.
"""

from __future__ import annotations

import json
import os
import shutil

import torch

from llama_megatron.checkpoint.interop.hf_reader import TOKENIZER_FILES, copy_assets
from llama_megatron.checkpoint.interop.safetensors_stream import SafetensorsShardWriter
from llama_megatron.checkpoint.sources import TensorSource
from llama_megatron.config import ModelConfig
from llama_megatron.model import released_tensors
from llama_megatron.model.param_layout import ParamLayout
from llama_megatron.model.released_tensors import Getter
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


def _file_tensors(source: TensorSource, config: ModelConfig) -> tuple[dict[str, tuple[int, ...]], Getter]:
    """The HF files' tensors (name -> shape, in the table's order) and how each is made from ``source``: the
    table's own, or the family's file tensors (Llama 4's fused experts, its interleaved q/k rows)."""
    shapes = ParamLayout(config).hf_shapes()
    if not released_tensors.differs(config):
        return shapes, source.get
    return (released_tensors.file_shapes(shapes, config),
            lambda name: released_tensors.file_tensor(name, source.get, config))


def write_hf_directory(source: TensorSource, config: ModelConfig, out_dir: str, dtype: torch.dtype,
                       assets_dir: str | None = None, max_shard_bytes: int = 5 * 2**30,
                       progress: TaskProgress | None = None) -> list[str]:
    """Fill ``out_dir``; returns the tokenizer/generation files copied from ``assets_dir``."""
    layout = ParamLayout(config)
    if released_tensors.differs(config):  # the family's own file tensors (Llama 4's fused experts)
        shapes, get = _file_tensors(source, config)
        writer = SafetensorsShardWriter(out_dir, [(name, shape, dtype) for name, shape in shapes.items()],
                                        max_shard_bytes)
        for name, shape in shapes.items():
            writer.write(name, get(name))
            source.release()
            if progress:
                progress.advance(0, torch.Size(shape).numel() * dtype.itemsize)
        if progress:
            progress.advance(len(layout.specs), 0)
    else:
        writer = SafetensorsShardWriter(out_dir, [(name, shape, dtype) for name, shape in layout.hf_shapes().items()],
                                        max_shard_bytes)
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


def write_into_release(source: TensorSource, config: ModelConfig, original_dir: str, out_dir: str) -> tuple[int, int]:
    """``out_dir`` as a copy of the released HF directory ``original_dir`` whose model tensors (the text model's,
    under a multimodal checkpoint's prefix) are the checkpoint's, cast to each original tensor's dtype; every other
    tensor (a vision tower, a projector) and file is copied unchanged, shard by shard under the same file names.
    Returns (tensors replaced, tensors kept); a tensor the checkpoint holds that the release lacks, or of another
    shape, is an error before anything is written."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from llama_megatron.checkpoint.interop.hf_reader import HFCheckpoint
    from llama_megatron.errors import CheckpointError

    files = HFCheckpoint(original_dir)
    if files.kind != "safetensors":
        raise CheckpointError(f"--into {original_dir}: the release must be safetensors (it holds .bin files)")
    prefix, _ = released_tensors.text_model_names(files.names(), config)
    shapes, get = _file_tensors(source, config)
    for name, shape in shapes.items():
        if prefix + name not in files.names():
            raise CheckpointError(f"--into {original_dir} holds no {prefix + name}: is it this model's release?")
        if tuple(files.info(prefix + name)[0]) != tuple(shape):
            raise CheckpointError(f"--into {original_dir}: {prefix + name} has shape {files.info(prefix + name)[0]}, "
                                  f"the checkpoint's is {tuple(shape)}")
    ours = {prefix + name: name for name in shapes}
    replaced = kept = 0
    for file in files.files:
        with safe_open(os.path.join(original_dir, file), framework="pt") as handle:
            metadata = handle.metadata()
            tensors = {}
            for name in handle.keys():
                if name in ours:
                    tensors[name] = get(ours[name]).to(files.info(name)[1]).contiguous()
                    replaced += 1
                else:
                    tensors[name] = handle.get_tensor(name)
                    kept += 1
        save_file(tensors, os.path.join(out_dir, file), metadata=metadata)
        source.release()
    files.release()
    for name in sorted(os.listdir(original_dir)):  # the index, configs, tokenizer, processor files
        path = os.path.join(original_dir, name)
        if os.path.isfile(path) and not name.endswith(".safetensors"):
            shutil.copyfile(path, os.path.join(out_dir, name))
    return replaced, kept
