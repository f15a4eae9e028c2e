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
import re
from dataclasses import dataclass
from typing import Any

from llama_megatron.errors import CheckpointError, ConfigError
from llama_megatron.model.lora_layout import LoraConfig

META_FILE = "llama_megatron.json"
LATEST_FILE = "latest"
TMP_PREFIX = ".tmp-"
FORMAT_VERSION = 1


_TAG_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def step_tag(step: int) -> str:
    return f"global_step{step}"


def universal_tag(tag: str) -> str:
    """The name of ``tag``'s conversion to DeepSpeed's universal format, kept beside it."""
    return f"{tag}_universal"


def check_tag_name(tag: str, what: str) -> str:
    """A tag is a plain directory name (letters, digits, '.', '_', '-'): never a path that leads elsewhere."""
    if not isinstance(tag, str) or not _TAG_NAME.fullmatch(tag):
        raise CheckpointError(f"{what} {tag!r} is not a plain tag name (letters, digits, '.', '_' and '-', "
                              "starting with a letter or digit; no path)")
    return tag


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
    expert: int = 1  # expert-parallel degree: > 1 keeps the experts in files of their own (checkpoint/weights.py)
    format_version: int = FORMAT_VERSION
    lora: dict[str, Any] | None = None  # adapter-only checkpoint: rank, alpha, dropout, targets, base
    saved_at: float | None = None  # wall-clock time of the save (informational: clocks of nodes disagree)
    # this save's place among the save dir's saves (1 + the highest there): retention and the load fallback order
    # tags by it, never by a clock; None for older checkpoints and other tools' (ordered by step, below every save)
    save_index: int | None = None
    # which layers each pipeline rank holds (training.config.PipelineConfig.layer_placement; None: PP 1, or an
    # older checkpoint: DeepSpeed's one block per rank)
    layer_placement: dict[str, Any] | None = None
    # the run that saved it (training.config.TrainingConfig.run_record: what is trained, from where); None for
    # conversions, other tools' and older checkpoints
    run: dict[str, Any] | None = None
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
        for key in ("lora", "saved_at", "save_index", "run"):
            if data[key] is None:
                data.pop(key)
        return json.dumps(data, indent=2, sort_keys=True)


_POSITIVE = ("tensor", "pipeline", "data_parallel", "context", "expert", "padded_vocab_size")
_COUNTS = ("step", "consumed_samples")


def _check_fields(data: dict) -> None:
    """The fields everything after reads as numbers and objects are ones (an untrusted or hand-edited file would
    otherwise fail later, as a division by zero or a traceback deep in a reader)."""
    def integer(value) -> bool:
        return type(value) is int

    for key in _POSITIVE:
        if key in data and not (integer(data[key]) and data[key] >= 1):
            raise ValueError(f"{key} {data[key]!r} is not a positive integer")
    for key in _COUNTS:
        if key in data and not (integer(data[key]) and data[key] >= 0):
            raise ValueError(f"{key} {data[key]!r} is not an integer >= 0")
    if "zero_stage" in data and data["zero_stage"] not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage {data['zero_stage']!r} is not 0, 1, 2 or 3")
    for key in ("model", "lora", "layer_placement", "run"):
        if data.get(key) is not None and not isinstance(data[key], dict):
            raise ValueError(f"{key} is not an object")


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
    return check_tag_name(tag, f"{path} names")


def read_meta(load_dir: str, tag: str | None = None) -> CheckpointMeta:
    """The checkpoint's run position and layout; one-line errors for anything missing or unreadable."""
    tag = check_tag_name(tag, "checkpoint tag") if tag else read_latest(load_dir)
    tag_dir = os.path.join(load_dir, tag)
    if not os.path.isdir(tag_dir):
        raise CheckpointError(f"checkpoint {tag_dir} not found")
    meta_path = os.path.join(tag_dir, META_FILE)
    try:
        with open(meta_path, encoding="utf-8") as fh:
            data = json.load(fh)
        if not isinstance(data, dict):
            raise TypeError("not a JSON object")
        _check_fields(data)
        meta = CheckpointMeta(**data, tag=tag)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {tag_dir} is incomplete or not a llama_megatron checkpoint "
                              f"(no {META_FILE})") from None
    except (json.JSONDecodeError, TypeError, ValueError) as exc:
        raise CheckpointError(f"checkpoint metadata {meta_path} is corrupt: {exc}") from None
    if meta.format_version != FORMAT_VERSION:
        raise CheckpointError(f"{meta_path}: format version {meta.format_version}, expected {FORMAT_VERSION}")
    return meta


_STEP_TAG = re.compile(r"global_step(\d+)")


def _tag_order(save_dir: str) -> list[tuple[int, int, str]]:
    """(save index, step, name) of each complete tag in ``save_dir``: a tag without a save index (written before
    there were any, or by another tool) counts -1, and one not named by step -1 for its step."""
    found = []
    for name in os.listdir(save_dir) if os.path.isdir(save_dir) else []:
        meta_path = os.path.join(save_dir, name, META_FILE)
        if not _TAG_NAME.fullmatch(name) or name.endswith("_universal") or not os.path.isfile(meta_path):
            continue
        try:
            with open(meta_path, encoding="utf-8") as fh:
                index = json.load(fh).get("save_index")
        except (OSError, ValueError, AttributeError):
            index = None
        step = _STEP_TAG.fullmatch(name)
        found.append((index if type(index) is int else -1, int(step.group(1)) if step else -1, name))
    return sorted(found, reverse=True)


def saved_tags(save_dir: str) -> list[str]:
    """The complete tags in ``save_dir`` (holding ``llama_megatron.json``; temporaries and universal conversions
    excluded), newest save first: by the save index their metadata records, then by step. Never by wall-clock
    time: a node whose clock is behind would make its newer save look older (and retention delete it)."""
    return [name for _, _, name in _tag_order(save_dir)]


def next_save_index(save_dir: str) -> int:
    """The save index of the next save into ``save_dir``: one above every tag there."""
    return 1 + max((index for index, _, _ in _tag_order(save_dir)), default=-1)
