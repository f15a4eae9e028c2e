"""The three conversions, each validated completely before the first byte is written:

- HF directory or Meta release -> our checkpoint at a chosen TP/PP (:func:`to_megatron`);
- our checkpoint (any TP/PP/ZeRO) -> HF directory (:func:`to_hf`); a LoRA checkpoint -> PEFT adapter directory,
  or merged into its base (:mod:`llama_megatron.checkpoint.interop.peft_export`);
- our checkpoint -> our checkpoint at another TP/PP (:func:`reshard`).

Outputs are built in a temp dir and renamed into place; the HF config and tokenizer files travel in
``OUTPUT/hf_config/`` so a later export finds them.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass

import torch

from llama_megatron.checkpoint.atomic import atomic_output_dir, check_output
from llama_megatron.checkpoint.directory import check_tag_name
from llama_megatron.checkpoint.interop.hf_reader import (
    HF_ASSET_FILES,
    HF_CONFIG_DIR,
    copy_assets,
    open_hf_weights,
)
from llama_megatron.checkpoint.interop.hf_writer import (
    DTYPE_NAMES,
    hf_config_dict,
    write_hf_directory,
    write_into_release,
)
from llama_megatron.checkpoint.interop.meta_release import MetaCheckpoint, is_meta_checkpoint
from llama_megatron.checkpoint.interop.peft_export import export_lora
from llama_megatron.checkpoint.megatron_reader import MegatronCheckpoint
from llama_megatron.checkpoint.megatron_writer import DEFAULT_TAG, write_megatron_checkpoint
from llama_megatron.checkpoint.sources import TensorSource, check_source
from llama_megatron.config import ModelConfig
from llama_megatron.errors import CheckpointError
from llama_megatron.model.param_layout import ParamLayout
from llama_megatron.parallel.degrees import ParallelConfig
from llama_megatron.progress import TaskProgress


@dataclass
class Result:
    output: str
    seconds: float
    dtype: torch.dtype
    note: str = ""


def _dtype(name: str | None) -> torch.dtype | None:
    if name is None:
        return None
    if name not in DTYPE_NAMES:
        raise CheckpointError(f"unknown dtype {name!r}: choose {', '.join(DTYPE_NAMES)}")
    return DTYPE_NAMES[name]


def _progress(label: str, config: ModelConfig, enabled: bool) -> TaskProgress | None:
    """A progress line over the model's parameters (stderr), or None."""
    return TaskProgress(label, total=len(ParamLayout(config).specs)) if enabled else None


def _layout(config: ModelConfig, tp: int, pp: int, divisible_by: int) -> int:
    """Validate TP/PP against the model (ConfigError) and return the padded vocabulary for this TP."""
    parallel = ParallelConfig(tensor=tp, pipeline=pp, make_vocab_size_divisible_by=divisible_by)
    parallel.validate(config)
    return parallel.local_shapes(config).padded_vocab_size


def _write_meta_assets(meta: MetaCheckpoint, dtype: torch.dtype, dst: str) -> str:
    """config.json from params.json; the tokenizer.model beside the weights (or one dir up, LLaMA-2's layout)."""
    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(dst, "config.json"), "w", encoding="utf-8") as fh:
        json.dump(hf_config_dict(meta.config, dtype), fh, indent=2, sort_keys=True)
    for folder in (meta.meta_dir, os.path.dirname(os.path.abspath(meta.meta_dir))):
        path = os.path.join(folder, "tokenizer.model")
        if os.path.isfile(path):
            shutil.copyfile(path, os.path.join(dst, "tokenizer.model"))
            with open(path, "rb") as fh:
                sentencepiece = fh.read(1) == b"\x0a"  # a serialized ModelProto starts with field 1
            if not sentencepiece:
                return ("tokenizer.model is a tiktoken file (LLaMA-3): export with --tokenizer pointing at an HF "
                        "tokenizer directory")
            special = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
            with open(os.path.join(dst, "tokenizer_config.json"), "w", encoding="utf-8") as fh:
                json.dump({"tokenizer_class": "LlamaTokenizer", **special, "add_bos_token": True,
                           "add_eos_token": False}, fh, indent=2)
            return ""
    return "no tokenizer.model beside the Meta weights: export with --tokenizer"


def open_input(path: str, max_position_embeddings: int | None = None,
               input_format: str = "auto") -> tuple[TensorSource, ModelConfig, str]:
    """An HF directory or a Meta release (``input_format`` auto, hf or meta): (source, model config, kind)."""
    if not os.path.isdir(path):
        raise CheckpointError(f"input directory not found: {path}")
    if input_format == "meta" or (input_format == "auto" and is_meta_checkpoint(path)
                                  and not os.path.isfile(os.path.join(path, "config.json"))):
        meta = MetaCheckpoint(path, max_position_embeddings)
        return meta, meta.config, "meta"
    config = ModelConfig.from_file(path)
    return open_hf_weights(path, config), config, "hf"


def to_megatron(input_dir: str, output: str, tp: int, pp: int, *, divisible_by: int = 128,
                dtype: str | None = None, tag: str = DEFAULT_TAG, overwrite: bool = False,
                max_position_embeddings: int | None = None, input_format: str = "auto",
                show_progress: bool = False) -> Result:
    start = time.perf_counter()
    check_output(output, overwrite, inputs=(input_dir,))
    check_tag_name(tag, "--tag")
    source, config, kind = open_input(input_dir, max_position_embeddings, input_format)
    padded = _layout(config, tp, pp, divisible_by)
    check_source(source, config, input_dir)
    stored = source.info("model.embed_tokens.weight")[1]
    source.release()  # drop the handles opened for checking
    out_dtype = _dtype(dtype)
    left_out = getattr(source, "left_out", ())
    note = (f"the text model of a multimodal checkpoint: {len(left_out)} other tensors (the vision tower, the "
            "projector) left out" if left_out else "")
    with atomic_output_dir(output, overwrite) as tmp:
        progress = _progress(f"{kind}-to-megatron", config, show_progress)
        write_megatron_checkpoint(source, config, tmp, tp, pp, padded, out_dtype, tag, progress)
        if progress:
            progress.close()
        assets = os.path.join(tmp, HF_CONFIG_DIR)
        if kind == "meta":
            note = _write_meta_assets(source, out_dtype or stored, assets)
        else:
            copy_assets(input_dir, assets, HF_ASSET_FILES)
    return Result(output, time.perf_counter() - start, out_dtype or stored, note)


def to_hf(input_dir: str, output: str, *, dtype: str | None = None, tag: str | None = None,
          tokenizer: str | None = None, max_shard_bytes: int = 5 * 2**30, overwrite: bool = False,
          show_progress: bool = False, merge: bool = False, base: str | None = None,
          base_model: str | None = None, into: str | None = None) -> Result:
    """A full checkpoint -> HF directory; a LoRA checkpoint -> PEFT adapter (``base_model`` recorded in its
    config), or with ``merge`` its base (recorded, or ``base``) with the adapters merged in. ``into``: the output
    is that released directory with the checkpoint's weights in its files (:func:`write_into_release`)."""
    start = time.perf_counter()
    check_output(output, overwrite, inputs=(input_dir,) + ((into,) if into else ()))
    requested = _dtype(dtype)
    # fp32 export of bf16 training prefers the fp32 master weights of the optimizer partitions
    source = MegatronCheckpoint(input_dir, tag, fp32_master=requested == torch.float32)
    out_dtype = requested or source.stored_dtype
    assets = tokenizer
    if assets is not None and not os.path.isdir(assets):
        raise CheckpointError(f"--tokenizer {assets} is not a directory")
    if source.lora is not None:
        out_dtype, note = export_lora(source, output, dtype=requested, merge=merge, base_dir=base,
                                      base_model=base_model, assets_dir=assets, max_shard_bytes=max_shard_bytes,
                                      overwrite=overwrite, show_progress=show_progress)
        return Result(output, time.perf_counter() - start, out_dtype, note)
    if merge or base or base_model:
        raise CheckpointError(f"{source.tag_dir} holds a full model: --merge, --base and --base-model apply to LoRA "
                              "checkpoints")
    if into is not None:
        with atomic_output_dir(output, overwrite) as tmp:
            replaced, kept = write_into_release(source, source.config, into, tmp)
        return Result(output, time.perf_counter() - start, source.stored_dtype if requested is None else requested,
                      f"{replaced} tensors of {into} replaced, {kept} others copied unchanged")
    if assets is None and os.path.isdir(os.path.join(input_dir, HF_CONFIG_DIR)):
        assets = os.path.join(input_dir, HF_CONFIG_DIR)
    with atomic_output_dir(output, overwrite) as tmp:
        progress = _progress("megatron-to-hf", source.config, show_progress)
        copied = write_hf_directory(source, source.config, tmp, out_dtype, assets, max_shard_bytes, progress)
        if progress:
            progress.close()
    note = f"weights from {source.source_kind}"
    if not any(name.startswith("tokenizer") for name in copied):
        note += "; no tokenizer files copied (pass --tokenizer DIR)"
    return Result(output, time.perf_counter() - start, out_dtype, note)


def reshard(input_dir: str, output: str, tp: int, pp: int, *, divisible_by: int = 128, tag: str | None = None,
            out_tag: str = DEFAULT_TAG, dtype: str | None = None, overwrite: bool = False,
            show_progress: bool = False) -> Result:
    start = time.perf_counter()
    check_output(output, overwrite, inputs=(input_dir,))
    check_tag_name(out_tag, "--output-tag")
    source = MegatronCheckpoint(input_dir, tag, fp32_master=dtype == "fp32")
    if source.lora is not None:
        raise CheckpointError(f"{source.tag_dir} holds LoRA adapters only, which reshard does not re-split: merge "
                              "them with `llama-megatron export --merge`, then convert the result")
    padded = _layout(source.config, tp, pp, divisible_by)
    out_dtype = _dtype(dtype) or source.dtype
    with atomic_output_dir(output, overwrite) as tmp:
        progress = _progress("reshard", source.config, show_progress)
        write_megatron_checkpoint(source, source.config, tmp, tp, pp, padded, out_dtype, out_tag, progress)
        if progress:
            progress.close()
        hf_config = os.path.join(input_dir, HF_CONFIG_DIR)
        if os.path.isdir(hf_config):
            shutil.copytree(hf_config, os.path.join(tmp, HF_CONFIG_DIR))
    note = f"weights from {source.source_kind} of {source.tag_dir} (weights only: start with checkpoint.finetune)"
    return Result(output, time.perf_counter() - start, out_dtype, note)
