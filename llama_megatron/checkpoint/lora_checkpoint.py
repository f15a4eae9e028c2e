"""Which base checkpoint a LoRA run's adapters belong to, and every check that pairs the two.

A LoRA run saves its adapters only (and the modules it trains in full, and their optimizer state).
``llama_megatron.json`` records the adapter config (modules to save included) and the base checkpoint: its absolute path, tag and a fingerprint, a sha256 of the model config, every norm weight
and the first rows of the embedding (a few KB read from any layout, ZeRO-3 partitions included), so a base that was
replaced or retrained under the same path is told apart while the same base resharded is not. Resuming,
fine-tuning from and merging adapters re-read the base there (or where ``export --base`` says), and refuse, with
one line, a base whose fingerprint differs.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import Any

from llama_megatron.checkpoint.directory import CheckpointMeta, read_meta
from llama_megatron.checkpoint.megatron_reader import MegatronCheckpoint
from llama_megatron.errors import CheckpointError, ConfigError
from llama_megatron.model.lora_layout import LoraConfig

FINGERPRINT_EMBEDDING_ROWS = 8


@dataclass(frozen=True)
class BaseRecord:
    """The base checkpoint of a LoRA run, as ``llama_megatron.json`` records it."""

    path: str
    tag: str
    fingerprint: str

    def to_dict(self) -> dict[str, str]:
        return {"path": self.path, "tag": self.tag, "fingerprint": self.fingerprint}

    @classmethod
    def of(cls, meta: CheckpointMeta, where: str) -> BaseRecord:
        base = (meta.lora or {}).get("base")
        try:
            return cls(str(base["path"]), str(base["tag"]), str(base["fingerprint"]))
        except (TypeError, KeyError):
            raise CheckpointError(f"checkpoint {where} holds LoRA adapters but records no base checkpoint "
                                  "(lora.base with path, tag, fingerprint in llama_megatron.json)") from None


def fingerprint(load_dir: str, tag: str | None = None) -> str:
    """A content fingerprint of a full checkpoint (see the module docstring); its files are checked against the
    manifest by size here (the run that loads it verifies checksums)."""
    source = MegatronCheckpoint(load_dir, tag, checksum=False)
    if source.lora is not None:
        raise CheckpointError(f"{source.tag_dir} holds LoRA adapters, not a base model")
    digest = hashlib.sha256(json.dumps(source.meta.model, sort_keys=True).encode())
    for spec in source.layout:
        if spec.split == "replicated" and spec.init == "ones" or spec.name == "embed.weight":
            tensor = source.read_rank(spec, 0)
            if spec.name == "embed.weight":
                tensor = tensor[:FINGERPRINT_EMBEDDING_ROWS]
            digest.update(spec.name.encode())
            digest.update(tensor.float().contiguous().numpy().tobytes())
            source.release()
    return "sha256:" + digest.hexdigest()


def base_record(load_dir: str, tag: str) -> BaseRecord:
    return BaseRecord(os.path.abspath(load_dir), tag, fingerprint(load_dir, tag))


def checkpoint_lora_section(lora: LoraConfig, base: BaseRecord) -> dict[str, Any]:
    """``llama_megatron.json``'s ``lora`` for a LoRA run's saves."""
    return {**lora.to_dict(), "base": base.to_dict()}


def find_base(record: BaseRecord, where: str, base_dir: str | None = None) -> CheckpointMeta:
    """The base checkpoint of adapters ``where``: at its recorded path (or ``base_dir``, with the recorded tag when
    it has one, else its latest), holding the model the adapters were trained on."""
    path = base_dir or record.path
    tag = record.tag if base_dir is None or os.path.isdir(os.path.join(base_dir, record.tag)) else None
    if base_dir is None and not os.path.isdir(os.path.join(path, tag)):
        raise CheckpointError(f"the base checkpoint of the adapters in {where}, {path}/{tag}, is missing: put it "
                              "back (or export with --base DIR)")
    meta = read_meta(path, tag)
    got = fingerprint(path, meta.tag)
    if got != record.fingerprint:
        raise CheckpointError(f"the adapters in {where} belong to base checkpoint {record.path}/{record.tag} "
                              f"({record.fingerprint[:19]}), {path}/{meta.tag} is another model ({got[:19]})")
    return meta


def check_lora_start(lora: LoraConfig | None, meta: CheckpointMeta | None, load_dir: str | None,
                     finetune: bool, auto: bool = False) -> tuple[BaseRecord | None, CheckpointMeta | None]:
    """What a run with the ``lora`` section (or none) may load from ``meta``; returns the base record of a LoRA run
    and, when ``meta`` holds adapters, the base checkpoint's metadata."""
    adapters = meta.adapters() if meta else None
    where = f"{load_dir}/{meta.tag}" if meta else ""
    if lora is None:
        if adapters is not None:
            raise ConfigError(f"checkpoint {where} holds LoRA adapters only ({adapters.describe()}): load it with its "
                              "lora section in the training config, or merge it into its base with "
                              "`llama-megatron export --merge`")
        return None, None
    if meta is None:
        if auto:
            raise ConfigError("LoRA with checkpoint.load auto: checkpoint.save holds no checkpoint yet, and a LoRA "
                              "run starts from a base model: run the first job with checkpoint.load=BASE_DIR and "
                              "checkpoint.finetune=true")
        raise ConfigError("lora trains adapters on a frozen base model: set checkpoint.load to the base checkpoint "
                          "and checkpoint.finetune to true")
    if adapters is None:
        if not finetune:
            raise ConfigError(f"checkpoint {where} is a full model: a LoRA run starts from it with "
                              "checkpoint.finetune true (its weights only)")
        return base_record(load_dir, meta.tag), None
    if not lora.same_adapters(adapters):
        raise ConfigError(f"checkpoint {where} holds LoRA adapters of {adapters.describe()}; this run's lora section "
                          f"has {lora.describe()}")
    record = BaseRecord.of(meta, where)
    return record, find_base(record, where)
