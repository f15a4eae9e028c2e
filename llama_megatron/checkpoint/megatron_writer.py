"""Write a weights-only checkpoint in exactly the layout training reads (``checkpoint.load`` + ``finetune``).

``DIR/latest`` names the tag; ``DIR/<tag>/`` holds, per TP rank, DeepSpeed pipeline layer files
``layer_{idx:02d}-model_{tp:02d}-model_states.pt`` (keys relative to the layer, a tied embedding only in layer 0)
when PP > 1, or ``mp_rank_{tp:02d}_model_states.pt`` = ``{"module": state dict}`` when PP = 1, plus
``llama_megatron.json`` (step 0, ZeRO 0, DP 1). Tensors stream from the source one parameter at a time into
pre-laid-out torch archives, so memory stays at about one parameter.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable

import torch

from llama_megatron.checkpoint.hf_mapping import canonical_names, hf_sources, layer_index, module_name
from llama_megatron.checkpoint.sources import TensorSource, expected_hf_shapes
from llama_megatron.checkpoint.torch_stream import StreamingTorchFile
from llama_megatron.checkpoint.tp_parts import shard_parts, shard_shape
from llama_megatron.checkpoint.weights import layer_file, layer_key, model_states_file
from llama_megatron.config import ModelConfig
from llama_megatron.errors import CheckpointError
from llama_megatron.training.checkpointing import LATEST_FILE, META_FILE, CheckpointMeta, write_text_atomic

DEFAULT_TAG = "converted"


def check_tag(tag: str) -> None:
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", tag) or tag in (".", ".."):
        raise CheckpointError(f"checkpoint tag {tag!r} must be a plain name (letters, digits, '_', '.', '-')")


def write_megatron_checkpoint(source: TensorSource, config: ModelConfig, out_dir: str, tp: int, pp: int,
                              padded_vocab_size: int, dtype: torch.dtype | None = None, tag: str = DEFAULT_TAG,
                              log: Callable[[str], None] | None = None) -> str:
    """Write ``out_dir/tag`` and ``out_dir/latest``; returns the tag directory."""
    check_tag(tag)
    tag_dir = os.path.join(out_dir, tag)
    os.makedirs(tag_dir, exist_ok=True)
    hf_shapes = expected_hf_shapes(config)

    def spec(canonical: str, rank: int) -> tuple[tuple[int, ...], torch.dtype]:
        shape = shard_shape(canonical, config, rank, tp, padded_vocab_size, hf_shapes)
        return shape, dtype or source.info(hf_sources(canonical, config)[0])[1]

    def stream(canonicals: list[str], writers: list[StreamingTorchFile], key: Callable[[str], str]) -> None:
        for i, canonical in enumerate(canonicals):
            for rank, writer in enumerate(writers):
                writer.write(key(canonical), *shard_parts(canonical, source.get, config, rank, tp,
                                                          padded_vocab_size))
            source.release()  # drop this parameter's mapped pages before the next one
            idx = layer_index(canonical, config)[0]
            if log and (i + 1 == len(canonicals) or layer_index(canonicals[i + 1], config)[0] != idx):
                log(f"layer {idx}/{config.num_hidden_layers + 2} written")

    names = canonical_names(config)
    if pp == 1:
        def module_key(c: str) -> str:
            return module_name(c, config)

        writers = [StreamingTorchFile(model_states_file(tag_dir, rank), {module_key(c): spec(c, rank) for c in names},
                                      wrap=lambda state: {"module": state})
                   for rank in range(tp)]
        stream(names, writers, module_key)
        for writer in writers:
            writer.close()
    else:
        def key(c: str) -> str:
            return layer_key(c, config)

        by_layer: dict[int, list[str]] = {}
        for canonical in names:
            by_layer.setdefault(layer_index(canonical, config)[0], []).append(canonical)
        for idx, canonicals in sorted(by_layer.items()):
            writers = [StreamingTorchFile(layer_file(tag_dir, idx, rank), {key(c): spec(c, rank) for c in canonicals})
                       for rank in range(tp)]
            stream(canonicals, writers, key)
            for writer in writers:
                writer.close()
    meta = CheckpointMeta(step=0, consumed_samples=0, tensor=tp, pipeline=pp, data_parallel=1, zero_stage=0,
                          model=config.to_dict(), padded_vocab_size=padded_vocab_size)
    write_text_atomic(os.path.join(tag_dir, META_FILE), meta.to_json())
    write_text_atomic(os.path.join(out_dir, LATEST_FILE), tag)
    return tag_dir
