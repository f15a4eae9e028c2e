"""GPT pretraining datasets over Megatron ``.bin``/``.idx`` prefixes (the ``pretrain`` data type).

Keys of its data section: ``prefix`` (str) or ``blend`` ([[weight, prefix], ...]); ``split`` (default
"969,30,1"); ``per_document_attention`` (adds position_ids/segment_ids); ``cache_dir`` (default: an
``index-cache`` directory beside each prefix); ``eod_id`` (token that ends a document inside a sequence).
Prefixes are relative to the CWD.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import numpy as np

from llama_megatron.data.blended_dataset import BlendedDataset
from llama_megatron.data.index_cache import cached_arrays, check_token_range, file_fingerprint
from llama_megatron.data.indexed_dataset import MMapIndexedDataset, data_paths
from llama_megatron.data.sample_index import (
    build_doc_idx,
    build_sample_idx,
    build_shuffle_idx,
    num_epochs_needed,
    parse_split,
    split_document_ranges,
)
from llama_megatron.errors import ConfigError, DataError

DEFAULT_SPLIT = "969,30,1"
SPLIT_NAMES = ("train", "valid", "test")
KNOWN_KEYS = {"type", "prefix", "blend", "split", "per_document_attention", "cache_dir", "eod_id"}
# Megatron over-samples each blended component by 0.5% so the greedy blend never runs a component dry.
BLEND_OVERSAMPLE = 1.005
INDEX_VERSION = 2


class GPTDataset:
    """Samples of ``seq_length + 1`` tokens packed across document boundaries of one split of one prefix.

    ``ds[i]`` is a dict: ``tokens`` (int64, seq_length + 1); with ``per_document_attention`` also
    ``position_ids`` and ``segment_ids`` (int64, seq_length, for ``tokens[:-1]``): positions restart at 0 where
    a document starts (a document boundary of the index, or right after an ``eod_id`` token) and segment ids
    count the documents of the sample from 0.
    """

    def __init__(
        self,
        indexed: MMapIndexedDataset,
        split_id: int,
        doc_range: tuple[int, int],
        seq_length: int,
        num_samples: int,
        seed: int,
        cache_dir: str,
        per_document_attention: bool = False,
        eod_id: int | None = None,
        vocab_size: int | None = None,
    ) -> None:
        self.indexed = indexed
        self.vocab_size = vocab_size
        self.name = SPLIT_NAMES[split_id]
        self.seq_length = seq_length
        self.num_samples = num_samples
        self.per_document_attention = per_document_attention
        self.eod_id = eod_id
        self._tokens = indexed.tokens
        self._bounds = indexed.document_bounds()
        doc_sizes = np.diff(self._bounds)
        documents = np.arange(*doc_range, dtype=np.int64)
        tokens_per_epoch = int(doc_sizes[documents].sum())
        if tokens_per_epoch == 0:
            raise ConfigError(
                f"{indexed.prefix}: the {self.name} split (documents {doc_range}) has no tokens"
            )
        self.num_epochs = num_epochs_needed(tokens_per_epoch, seq_length, num_samples)
        # Like Megatron, index and shuffle every sample of the epochs needed, not just the ones asked for: a
        # longer run (more train steps, same epoch count) then sees the same samples in the same order first.
        samples_in_epochs = (self.num_epochs * tokens_per_epoch - 1) // seq_length
        description = {
            "kind": "gpt-samples",
            "version": INDEX_VERSION,
            "index": file_fingerprint(data_paths(indexed.prefix)[1]),
            "num_tokens": indexed.num_tokens,
            "doc_range": list(doc_range),
            "split_id": split_id,
            "seq_length": seq_length,
            "num_epochs": self.num_epochs,
            "seed": seed,
        }

        def build() -> dict[str, np.ndarray]:
            doc_idx = build_doc_idx(documents, self.num_epochs, seed, split_id)
            return {
                "doc_idx": doc_idx,
                "sample_idx": build_sample_idx(doc_sizes, doc_idx, seq_length, samples_in_epochs),
                "shuffle_idx": build_shuffle_idx(samples_in_epochs, seed, split_id),
            }

        name = f"{os.path.basename(indexed.prefix)}-{self.name}"
        arrays = cached_arrays(cache_dir, name, description, build)
        self.doc_idx, self.sample_idx, self.shuffle_idx = (
            arrays["doc_idx"],
            arrays["sample_idx"],
            arrays["shuffle_idx"],
        )

    def __len__(self) -> int:
        return self.num_samples

    def _pieces(self, j: int) -> list[tuple[int, int]]:
        """(start, end) token ranges in the flat token array that make up unshuffled sample ``j``."""
        (pos0, off0), (pos1, off1) = self.sample_idx[j], self.sample_idx[j + 1]
        pieces = []
        for pos in range(int(pos0), int(pos1) + 1):
            doc = int(self.doc_idx[pos])
            start = int(self._bounds[doc]) + (int(off0) if pos == pos0 else 0)
            end = int(self._bounds[doc]) + int(off1) + 1 if pos == pos1 else int(self._bounds[doc + 1])
            if end > start:
                pieces.append((start, end))
        return pieces

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        if not -self.num_samples <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range for {self.num_samples} samples")
        pieces = self._pieces(int(self.shuffle_idx[i]))
        tokens = np.concatenate([self._tokens[s:e] for s, e in pieces]).astype(np.int64)
        if self.vocab_size is not None and (tokens.max() >= self.vocab_size or tokens.min() < 0):
            # Data tokenised with another tokenizer: fail here, not as an index error inside the embedding.
            bad = int(tokens.max() if tokens.max() >= self.vocab_size else tokens.min())
            raise DataError(
                f"{self.indexed.prefix}: sample {i} holds token id {bad}, outside the model's vocab_size "
                f"{self.vocab_size}; was it preprocessed with another tokenizer?"
            )
        item = {"tokens": tokens}
        if self.per_document_attention:
            starts = np.zeros(tokens.size, dtype=bool)
            starts[np.cumsum([e - s for s, e in pieces])[:-1]] = True
            if self.eod_id is not None:
                starts[1:] |= tokens[:-1] == self.eod_id
            item.update(document_positions(starts[:-1]))
        return item


def document_positions(starts: np.ndarray) -> dict[str, np.ndarray]:
    """position_ids restarting at each True of ``starts`` and segment_ids counting them (first segment 0)."""
    starts = starts.copy()
    starts[0] = False
    segment_ids = np.cumsum(starts, dtype=np.int64)
    idx = np.arange(starts.size, dtype=np.int64)
    segment_start = np.maximum.accumulate(np.where(starts, idx, 0))
    return {"position_ids": idx - segment_start, "segment_ids": segment_ids}


def _blend_entries(data_config: dict) -> list[tuple[float, str]]:
    if "prefix" in data_config:
        prefix = data_config["prefix"]
        if not isinstance(prefix, str) or not prefix:
            raise ConfigError("data.prefix must be a non-empty string")
        return [(1.0, prefix)]
    blend = data_config["blend"]
    if not isinstance(blend, list) or not blend:
        raise ConfigError('data.blend must be a non-empty list like [[0.7, "web"], [0.3, "code"]]')
    entries = []
    for entry in blend:
        if (
            not isinstance(entry, (list, tuple))
            or len(entry) != 2
            or isinstance(entry[0], bool)
            or not isinstance(entry[0], (int, float))
            or not isinstance(entry[1], str)
        ):
            raise ConfigError(f"data.blend entry {entry!r} is not [weight, prefix]")
        if not entry[0] > 0 or math.isinf(entry[0]):
            raise ConfigError(f"data.blend weight {entry[0]!r} for {entry[1]!r} must be positive and finite")
        entries.append((float(entry[0]), entry[1]))
    return entries


def validate_data_config(data_config: dict) -> None:
    """Raise ConfigError for anything wrong that can be seen without building indexes (call before launch)."""
    if not isinstance(data_config, dict):
        raise ConfigError("the data section must be a JSON object")
    unknown = sorted(set(data_config) - KNOWN_KEYS)
    if unknown:
        raise ConfigError(f"unknown data keys {', '.join(unknown)} (known: {', '.join(sorted(KNOWN_KEYS))})")
    sources = [k for k in ("prefix", "blend") if data_config.get(k) is not None]
    if len(sources) != 1:
        raise ConfigError("pretraining data needs exactly one of prefix or blend")
    parse_split(data_config.get("split", DEFAULT_SPLIT))
    if not isinstance(data_config.get("per_document_attention", False), bool):
        raise ConfigError("data.per_document_attention must be true or false")
    eod = data_config.get("eod_id")
    if eod is not None and (isinstance(eod, bool) or not isinstance(eod, int) or eod < 0):
        raise ConfigError("data.eod_id must be a non-negative integer")
    for _, prefix in _blend_entries(data_config):
        missing = [p for p in data_paths(prefix) if not os.path.isfile(p)]
        if missing:
            raise ConfigError(f"data prefix {prefix!r}: {', '.join(missing)} not found (cwd {os.getcwd()})")


def input_files(data_config: dict) -> list[str]:
    """Every .bin/.idx file the section reads."""
    return [path for _, prefix in _blend_entries(data_config) for path in data_paths(prefix)]


def check_pretraining_data(data_config: dict, vocab_size: int, need_validation: bool) -> None:
    """What building the datasets would find late, found before launch: token ids beyond the vocabulary (each file
    read once, then cached) and, when evaluation is asked for, a split that gives validation no documents."""
    fractions = parse_split(data_config.get("split", DEFAULT_SPLIT))
    validation_docs = 0
    for _, prefix in _blend_entries(data_config):
        ds = MMapIndexedDataset(prefix)
        check_token_range(ds, _cache_dir(data_config, prefix), vocab_size)
        lo, hi = split_document_ranges(ds.num_documents, fractions)[1]
        validation_docs += hi - lo
    if need_validation and not validation_docs:
        raise ConfigError(f"eval.interval is set but data.split {data_config.get('split', DEFAULT_SPLIT)!r} gives "
                          "the validation split no documents: give it a share, or set eval.interval 0")


def _cache_dir(data_config: dict, prefix: str) -> str:
    return data_config.get("cache_dir") or os.path.join(os.path.dirname(prefix) or ".", "index-cache")


def build_train_valid_test_datasets(
    data_config: dict,
    seq_length: int,
    seed: int,
    num_samples: Sequence[int],
    *,
    vocab_size: int | None = None,
    eod_id: int | None = None,
):
    """(train, valid, test) datasets for ``num_samples`` = (train, valid, test) sample counts.

    ``vocab_size`` (the model's) makes every sample check that its ids fit the embedding table; ``eod_id`` (or data.eod_id) marks document ends inside sequences for per-document attention.

    A split is None when it was asked for 0 samples or the split string gives it no documents (as Megatron);
    an empty train split with train samples requested is an error. In a blend, components whose split has no
    documents are left out of that split and the remaining weights renormalised.
    """
    validate_data_config(data_config)
    if seq_length < 1:
        raise ConfigError(f"seq_length must be positive, got {seq_length}")
    if len(num_samples) != 3 or any(int(n) < 0 for n in num_samples):
        raise ConfigError(f"num_samples must be three non-negative counts, got {num_samples!r}")
    per_doc = bool(data_config.get("per_document_attention", False))
    eod = data_config.get("eod_id", eod_id)
    fractions = parse_split(data_config.get("split", DEFAULT_SPLIT))
    entries = _blend_entries(data_config)
    indexed = [(w, MMapIndexedDataset(p)) for w, p in entries]
    result = []
    for split_id, n in enumerate(num_samples):
        n = int(n)
        if n == 0:
            result.append(None)
            continue
        usable = []
        for weight, ds in indexed:
            doc_range = split_document_ranges(ds.num_documents, fractions)[split_id]
            if doc_range[1] > doc_range[0]:
                usable.append((weight, ds, doc_range))
            elif split_id == 0:
                raise ConfigError(
                    f"data prefix {ds.prefix!r}: split {data_config.get('split', DEFAULT_SPLIT)!r} leaves no "
                    f"documents for training ({ds.num_documents} documents)"
                )
        if not usable:
            result.append(None)
            continue

        def make(
            ds: MMapIndexedDataset, doc_range: tuple[int, int], count: int, split_id: int = split_id
        ) -> GPTDataset:
            return GPTDataset(
                ds,
                split_id,
                doc_range,
                seq_length,
                count,
                seed,
                _cache_dir(data_config, ds.prefix),
                per_doc,
                eod,
                vocab_size,
            )

        if len(usable) == 1:
            result.append(make(usable[0][1], usable[0][2], n))
            continue
        total = sum(w for w, _, _ in usable)
        weights = [w / total for w, _, _ in usable]
        parts = [
            make(ds, rng, int(math.ceil(n * w * BLEND_OVERSAMPLE)))
            for w, (_, ds, rng) in zip(weights, usable)
        ]
        result.append(BlendedDataset(parts, weights, n, _cache_dir(data_config, usable[0][1].prefix)))
    return tuple(result)
