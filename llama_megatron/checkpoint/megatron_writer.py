"""Write a weights-only checkpoint in exactly the layout training reads (``checkpoint.load`` + ``finetune``).

``DIR/latest`` names the tag; ``DIR/<tag>/`` holds, per TP rank, DeepSpeed pipeline layer files
``layer_{idx:02d}-model_{tp:02d}-model_states.pt`` (keys relative to the layer, a tied embedding only in layer 0)
when PP > 1, or ``mp_rank_{tp:02d}_model_states.pt`` = ``{"module": state dict}`` when PP = 1, plus
``llama_megatron.json`` (step 0, ZeRO 0, DP 1). Tensors stream from the source one parameter at a time into
pre-laid-out torch archives, so memory stays at about one parameter.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from llama_megatron.checkpoint.atomic import write_text_atomic
from llama_megatron.checkpoint.directory import LATEST_FILE, META_FILE, CheckpointMeta, check_tag_name
from llama_megatron.checkpoint.manifest import write_manifest_for
from llama_megatron.checkpoint.sources import TensorSource
from llama_megatron.checkpoint.torch_stream import StreamingTorchFile
from llama_megatron.checkpoint.weights import layer_file, model_states_file
from llama_megatron.config import ModelConfig
from llama_megatron.model.param_layout import ParamLayout, ParamSpec
from llama_megatron.model.tp_slicing import shard_parts, shard_shape
from llama_megatron.progress import TaskProgress

DEFAULT_TAG = "converted"


def write_megatron_checkpoint(source: TensorSource, config: ModelConfig, out_dir: str, tp: int, pp: int,
                              padded_vocab_size: int, dtype: torch.dtype | None = None, tag: str = DEFAULT_TAG,
                              progress: TaskProgress | None = None) -> str:
    """Write ``out_dir/tag`` and ``out_dir/latest``; returns the tag directory."""
    check_tag_name(tag, "checkpoint tag")
    tag_dir = os.path.join(out_dir, tag)
    os.makedirs(tag_dir, exist_ok=True)
    layout = ParamLayout(config)

    def entry(spec: ParamSpec) -> tuple[tuple[int, ...], torch.dtype]:
        return shard_shape(spec, config, tp, padded_vocab_size), dtype or source.info(spec.hf_names[0])[1]

    def stream(specs: list[ParamSpec], writers: list[StreamingTorchFile], key: Callable[[ParamSpec], str]) -> None:
        for spec in specs:
            for rank, writer in enumerate(writers):
                writer.write(key(spec), *shard_parts(spec, source.get, config, rank, tp, padded_vocab_size))
            source.release()  # drop this parameter's mapped pages before the next one
            if progress:
                shard = entry(spec)
                progress.advance(1, tp * torch.Size(shard[0]).numel() * shard[1].itemsize)

    def module_key(spec: ParamSpec) -> str:
        return spec.module_name

    def layer_key(spec: ParamSpec) -> str:
        return spec.layer_key

    if pp == 1:
        writers = [StreamingTorchFile(model_states_file(tag_dir, rank), {s.module_name: entry(s) for s in layout},
                                      wrap=lambda state: {"module": state})
                   for rank in range(tp)]
        stream(list(layout), writers, module_key)
        for writer in writers:
            writer.close()
    else:
        by_layer: dict[int, list[ParamSpec]] = {}
        for spec in layout:
            by_layer.setdefault(spec.layers[0], []).append(spec)
        for idx, specs in sorted(by_layer.items()):
            writers = [StreamingTorchFile(layer_file(tag_dir, idx, rank), {s.layer_key: entry(s) for s in specs})
                       for rank in range(tp)]
            stream(specs, writers, layer_key)
            for writer in writers:
                writer.close()
    meta = CheckpointMeta(step=0, consumed_samples=0, tensor=tp, pipeline=pp, data_parallel=1, zero_stage=0,
                          model=config.to_dict(), padded_vocab_size=padded_vocab_size)
    write_text_atomic(os.path.join(tag_dir, META_FILE), meta.to_json())
    write_manifest_for(tag_dir)
    write_text_atomic(os.path.join(out_dir, LATEST_FILE), tag)
    return tag_dir
