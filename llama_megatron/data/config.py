"""The training JSON's ``data`` section: one typed class per ``data.type``, each building its own datasets.

``{"type": "pretrain", "prefix": ... | "blend": [...], "split": ..., "per_document_attention": ...}`` reads
Megatron ``.bin``/``.idx`` files; ``{"type": "synthetic"}`` draws random tokens; ``{"type": "sft", ...}`` is chat /
instruction JSONL for fine-tuning and ``{"type": "preference", ...}`` preference pairs (``sft/config.py``). Without ``type`` a section
with ``"synthetic": true`` is synthetic and anything else is pretraining data (the spelling of earlier
configs). A new kind of data is a new class in :data:`DATA_TYPES`, not a branch in another one.

Every type's datasets honour one sample contract (docs/data.md, "What a sample carries"): ``ds[i]`` is a dict
with ``tokens`` (int64, seq_length + 1) and optionally ``loss_mask`` (seq_length, 1 = the next token is
trained), ``position_ids`` and ``segment_ids`` (seq_length) for per-document attention of packed samples.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from llama_megatron.data.gpt_dataset import (
    DEFAULT_SPLIT,
    build_train_valid_test_datasets,
    check_pretraining_data,
    input_files,
    validate_data_config,
)
from llama_megatron.data.sft.config import PreferenceData, SFTData
from llama_megatron.data.sft.prompts import PromptData
from llama_megatron.data.synthetic import SyntheticDataset
from llama_megatron.errors import ConfigError

Splits = tuple  # (train, valid, test); a split is None when it has no samples


class DataConfig(Protocol):
    type: ClassVar[str]
    per_document_attention: bool

    def validate(self) -> None:
        """Everything checkable before launch (files exist, keys valid); raises ConfigError."""

    def prepare(self, tokenizer: str | None) -> None:
        """Work done once before the datasets are built (SFT: tokenise JSONL into its cache); idempotent."""

    def check(self, vocab_size: int, need_validation: bool) -> None:
        """After ``prepare``, before launch: token ids within ``vocab_size``, and a validation split with samples
        when evaluation is asked for; ConfigError otherwise."""

    def build(self, seq_length: int, seed: int, num_samples: tuple[int, int, int], vocab_size: int,
              eod_id: int | None) -> Splits:
        """(train, valid, test) datasets of ``num_samples`` samples each."""

    def files(self) -> list[str]:
        """The input files the section reads (``doctor`` checks every rank sees the same ones)."""

    def to_dict(self) -> dict[str, Any]:
        """The section as written in the training JSON."""


@dataclass
class PretrainData:
    type: ClassVar[str] = "pretrain"
    prefix: str | None = None  # the .bin/.idx prefix of one tokenised corpus
    # [[weight, prefix], ...]: corpora mixed by Megatron's greedy rule (instead of prefix)
    blend: list | None = None
    split: str = DEFAULT_SPLIT  # train, validation, test proportions by documents
    # position_ids and segment_ids restart at each document of a packed sample
    per_document_attention: bool = False
    cache_dir: str | None = None  # where the sample index is cached (default: index-cache/ beside the data)
    eod_id: int | None = None  # a token that also ends a document inside a sequence (per-document attention)

    def to_dict(self) -> dict[str, Any]:
        fields = {k: v for k, v in dataclasses.asdict(self).items() if v is not None}
        return {"type": self.type, **fields}

    def validate(self) -> None:
        validate_data_config(self.to_dict())

    def prepare(self, tokenizer: str | None) -> None:
        pass  # preprocessed by the preprocess verb

    def check(self, vocab_size: int, need_validation: bool) -> None:
        check_pretraining_data(self.to_dict(), vocab_size, need_validation)

    def files(self) -> list[str]:
        return input_files(self.to_dict())

    def build(self, seq_length: int, seed: int, num_samples: tuple[int, int, int], vocab_size: int,
              eod_id: int | None) -> Splits:
        return build_train_valid_test_datasets(self.to_dict(), seq_length, seed, num_samples,
                                               vocab_size=vocab_size, eod_id=eod_id)


@dataclass
class SyntheticData:
    type: ClassVar[str] = "synthetic"
    per_document_attention: bool = False  # position_ids and segment_ids restart at each synthetic document

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.type, "per_document_attention": self.per_document_attention}

    def validate(self) -> None:
        if not isinstance(self.per_document_attention, bool):
            raise ConfigError("data.per_document_attention must be true or false")

    def prepare(self, tokenizer: str | None) -> None:
        pass  # nothing to read

    def check(self, vocab_size: int, need_validation: bool) -> None:
        pass  # random ids below vocab_size, any number of validation samples

    def files(self) -> list[str]:
        return []

    def build(self, seq_length: int, seed: int, num_samples: tuple[int, int, int], vocab_size: int,
              eod_id: int | None) -> Splits:
        return tuple(SyntheticDataset(int(n), seq_length, vocab_size, seed, split_id, self.per_document_attention)
                     if n else None for split_id, n in enumerate(num_samples))


DATA_TYPES: dict[str, type] = {
    cls.type: cls for cls in (PretrainData, SyntheticData, SFTData, PreferenceData, PromptData)}


def data_config_from_dict(section: Any) -> DataConfig:
    """The typed section for a ``data`` object of the training JSON; one-line ConfigError otherwise."""
    if not isinstance(section, dict):
        raise ConfigError("the data section must be a JSON object")
    section = dict(section)
    legacy_synthetic = section.pop("synthetic", None)
    if legacy_synthetic not in (None, True, False):
        raise ConfigError("data.synthetic must be true or false")
    kind = section.pop("type", "synthetic" if legacy_synthetic else "pretrain")
    if kind not in DATA_TYPES:
        raise ConfigError(f"data.type {kind!r} is not one of {', '.join(sorted(DATA_TYPES))}")
    if legacy_synthetic and kind != "synthetic":
        raise ConfigError(f"data.synthetic is set but data.type is {kind!r}")
    cls = DATA_TYPES[kind]
    known = {f.name for f in dataclasses.fields(cls) if not f.name.startswith("_")}
    unknown = sorted(set(section) - known)
    if unknown:
        raise ConfigError(f"unknown keys for data.type {kind!r}: {', '.join(unknown)} "
                          f"(known: {', '.join(sorted(known))})")
    return cls(**section)
