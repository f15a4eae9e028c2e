"""What a checkpoint directory is: ``latest``, tags, and ``llama_megatron.json`` (run position and layout).

Layout of a checkpoint directory (a training save dir, or the output of ``convert`` / ``reshard``)::

    latest                      text: the newest complete tag (replaced atomically)
    <tag>/                      DeepSpeed files (mp_rank_*, layer_*, zero_pp_rank_*) + llama_megatron.json

``llama_megatron.json`` holds the run position (step, consumed samples) and the layout (TP, PP, DP, CP, ZeRO
stage, model config, padded vocabulary); everything that reads a checkpoint reads it first, before building
anything, so a mismatch is a one-line error. A LoRA run's checkpoints hold the adapters only, and ``lora`` (the
adapter config and the base checkpoint they belong to: :mod:`llama_megatron.checkpoint.lora_checkpoint`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from llama_megatron.errors import CheckpointError, ConfigError
from llama_megatron.model.lora_layout import LoraConfig

META_FILE = "llama_megatron.json"
LATEST_FILE = "latest"
TMP_PREFIX = ".tmp-"
FORMAT_VERSION = 1


def step_tag(step: int) -> str:
    return f"global_step{step}"


@dataclass
class CheckpointMeta:
    step: int
    consumed_samples: int
    tensor: int
    pipeline: int
    data_parallel: int
    zero_stage: int
    model: dict[str, Any]
    padded_vocab_size: int
    context: int = 1  # context-parallel degree of the run that saved it (older checkpoints: 1)
    format_version: int = FORMAT_VERSION
    lora: dict[str, Any] | None = None  # adapter-only checkpoint: rank, alpha, dropout, targets, base
    tag: str = ""

    @property
    def zero_partitions(self) -> int:
        """Ranks DeepSpeed partitioned ZeRO state over: its data-parallel group, which holds the context ranks too
        (llama_megatron/parallel/context.py). The weights themselves do not depend on DP or CP."""
        return self.data_parallel * self.context

    def adapters(self) -> LoraConfig | None:
        """The LoRA config of an adapter-only checkpoint (None for a full model)."""
        if self.lora is None:
            return None
        try:
            return LoraConfig.from_dict({k: v for k, v in self.lora.items() if k != "base"})
        except (ConfigError, AttributeError) as exc:
            raise CheckpointError(f"checkpoint {self.tag}: the lora section of {META_FILE} is invalid: {exc}") from None

    def to_json(self) -> str:
        data = dict(self.__dict__)
        data.pop("tag")
        if data["lora"] is None:
            data.pop("lora")
        return json.dumps(data, indent=2, sort_keys=True)


def read_latest(load_dir: str) -> str:
    if not os.path.isdir(load_dir):
        raise CheckpointError(f"checkpoint directory not found: {load_dir}")
    path = os.path.join(load_dir, LATEST_FILE)
    if not os.path.isfile(path):
        raise CheckpointError(f"no checkpoint in {load_dir}: no '{LATEST_FILE}' file (name a tag to load)")
    with open(path, encoding="utf-8") as fh:
        tag = fh.read().strip()
    if not tag:
        raise CheckpointError(f"{path} is empty")
    return tag


def read_meta(load_dir: str, tag: str | None = None) -> CheckpointMeta:
    """The checkpoint's run position and layout; one-line errors for anything missing or unreadable."""
    tag = tag or read_latest(load_dir)
    tag_dir = os.path.join(load_dir, tag)
    if not os.path.isdir(tag_dir):
        raise CheckpointError(f"checkpoint {tag_dir} not found")
    meta_path = os.path.join(tag_dir, META_FILE)
    try:
        with open(meta_path, encoding="utf-8") as fh:
            data = json.load(fh)
        meta = CheckpointMeta(**data, tag=tag)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {tag_dir} is incomplete or not a llama_megatron checkpoint "
                              f"(no {META_FILE})") from None
    except (json.JSONDecodeError, TypeError) as exc:
        raise CheckpointError(f"checkpoint metadata {meta_path} is corrupt: {exc}") from None
    if meta.format_version != FORMAT_VERSION:
        raise CheckpointError(f"{meta_path}: format version {meta.format_version}, expected {FORMAT_VERSION}")
    return meta
