"""SFT samples from token + mask shards: one conversation per row padded to seq_length, or several packed.

Every item has ``tokens`` (seq_length + 1) and ``loss_mask`` (seq_length; 1 where the next token is a trained
target). A sample longer than seq_length + 1 tokens is truncated to its head or dropped (``overlong``); a truncated
sample left with no trained target is dropped too. Both are counted in :attr:`SFTDataset.stats`.

- **Padded** (``pack: false``): a row is one sample then pad tokens (masked). Plain causal attention: a real token
  never sees the pad tokens after it, so a row computes exactly what the sample alone does.
- **Packed** (``pack: true``): whole samples placed first-fit (``packing.py``) into rows of seq_length + 1 tokens;
  ``position_ids`` restart and ``segment_ids`` change at each sample (and at the pad tail), so the per-document
  attention path keeps samples apart under TP, SP and PP. A sample's first token is never a target, so no label
  crosses from one sample into the next.

Rows are built per epoch (samples of the split shuffled by (seed, split, epoch), packed, rows shuffled again) for as
many epochs as the requested samples need, and cached like the pretraining indices (``index_cache.py``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from llama_megatron.data.gpt_dataset import SPLIT_NAMES, document_positions
from llama_megatron.data.index_cache import cached_arrays, file_fingerprint
from llama_megatron.data.indexed_dataset import MMapIndexedDataset, data_paths
from llama_megatron.data.sample_index import parse_split, split_document_ranges
from llama_megatron.data.sft.packing import PACK_WINDOW, pack_rows
from llama_megatron.data.sft.preference_formats import PAIR_DOCUMENTS
from llama_megatron.data.sft.preprocess import read_meta, shard_prefixes
from llama_megatron.errors import ConfigError, DataError

OVERLONG = ("truncate", "drop")
STATS = ("samples", "truncated", "dropped_overlong", "dropped_untrained", "rows_per_epoch", "tokens_per_epoch",
         "epochs")
INDEX_VERSION = 1


@dataclass(frozen=True)
class PairTruncation:
    """How a preference pair's sequences are cut (TRL's ``max_length`` and ``truncation_mode``): each to its first
    ``max_length`` tokens, or its last with ``keep_end``."""

    max_length: int
    keep_end: bool = False

    def check_rows(self, seq_length: int, pack: bool) -> None:
        """ConfigError unless a sequence (two, packed) fits a row of ``seq_length + 1`` tokens."""
        capacity = seq_length + 1
        if self.max_length > capacity or (pack and 2 * self.max_length > capacity):
            raise ConfigError(f"data.max_length {self.max_length} does not fit rows of seq_length + 1 = "
                              f"{capacity} tokens{' twice (a packed pair)' if pack else ''}")


def _rng(seed: int, *stream: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([seed, *stream]))


class SFTShards:
    """The token and mask shards of one prefix (``preprocess-sft``'s outputs), checked against each other."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.meta = read_meta(prefix)
        names = shard_prefixes(prefix)
        self.tokens = MMapIndexedDataset(names["tokens"])
        self.mask = MMapIndexedDataset(names["mask"])
        if len(self.tokens) != len(self.mask) or not np.array_equal(self.tokens.sizes, self.mask.sizes):
            raise DataError(f"{prefix}: the token and mask shards do not hold the same samples")
        self.sizes = self.tokens.sizes.astype(np.int64)  # per document
        self.documents = int(self.meta.get("documents_per_sample", 1))  # a preference pair's two sequences
        if len(self.tokens) % self.documents:
            raise DataError(f"{prefix}: {len(self.tokens)} documents do not make samples of {self.documents}")

    def __len__(self) -> int:
        return len(self.tokens) // self.documents

    def fingerprint(self) -> dict:
        """What rows built from these shards depend on: both indexes and how the shards were made (masks can change
        under an unchanged index)."""
        return {"indexes": [file_fingerprint(data_paths(p)[1]) for p in shard_prefixes(self.prefix).values()],
                "meta": self.meta}


class SFTDataset:
    """``num_samples`` rows of one split; ``ds[i]`` is a dict (docs/data.md, "What a sample carries")."""

    def __init__(self, shards: SFTShards, split_id: int, sample_range: tuple[int, int], seq_length: int,
                 num_samples: int, seed: int, cache_dir: str, pack: bool = False, overlong: str = "truncate",
                 pad_id: int = 0, vocab_size: int | None = None, pairs: PairTruncation | None = None) -> None:
        if overlong not in OVERLONG:
            raise ConfigError(f"data.overlong {overlong!r}: choose {' or '.join(OVERLONG)}")
        if (pairs is not None) != (shards.documents == PAIR_DOCUMENTS):
            raise ConfigError(f"{shards.prefix}: preference shards are read as data.type preference, others as sft")
        self.shards = shards
        self.name = SPLIT_NAMES[split_id]
        self.seq_length = seq_length
        self.num_samples = num_samples
        self.pack = pack
        self.pad_id = pad_id
        self.vocab_size = vocab_size
        self.capacity = seq_length + 1
        self.pairs = pairs
        description = {"kind": "sft-rows", "version": INDEX_VERSION, "shards": shards.fingerprint(),
                       "sample_range": list(sample_range), "split_id": split_id, "seq_length": seq_length,
                       "num_samples": num_samples, "seed": seed, "pack": pack, "overlong": overlong,
                       "window": PACK_WINDOW}
        if pairs is not None:
            pairs.check_rows(seq_length, pack)
            description.update(kind="preference-rows", max_length=pairs.max_length, keep_end=pairs.keep_end)
        name = f"{os.path.basename(shards.prefix)}-sft-{self.name}"
        arrays = cached_arrays(cache_dir, name, description,
                               lambda: self._build(sample_range, seed, split_id, overlong))
        self.row_offsets, self.row_samples = arrays["row_offsets"], arrays["row_samples"]
        self.stats = {k: int(v) for k, v in zip(STATS, arrays["stats"])}
        rows_per_item = PAIR_DOCUMENTS if pairs is not None and not pack else 1
        self.stats["packing_efficiency"] = self.stats["tokens_per_epoch"] / max(
            self.stats["rows_per_epoch"] * rows_per_item * self.capacity, 1)
        if self.stats["rows_per_epoch"] == 0:
            raise ConfigError(f"{shards.prefix}: the {self.name} split has no sample that fits seq_length "
                              f"{seq_length} with a trained token ({self.describe()})")

    def _document_lengths(self) -> np.ndarray:
        """Each document's length in a row: truncated to a row (SFT) or to max_length (a pair's sequences)."""
        return np.minimum(self.shards.sizes, self.capacity if self.pairs is None else self.pairs.max_length)

    def _sample_lengths(self) -> np.ndarray:
        return self._document_lengths().reshape(-1, self.shards.documents).sum(axis=1)

    def _kept_pairs(self, ids: np.ndarray) -> tuple[np.ndarray, dict]:
        """TRL's rule: every pair kept under keep_end; under keep_start those whose prompt fills max_length
        dropped (no completion token would be left)."""
        max_length = self.pairs.max_length
        long = (self.shards.sizes.reshape(-1, PAIR_DOCUMENTS)[ids] > max_length).any(axis=1)
        keep = np.ones(ids.size, dtype=bool)
        if not self.pairs.keep_end:
            prompts = np.array([int(np.argmax(self.shards.mask.get(int(i) * PAIR_DOCUMENTS))) for i in ids[long]],
                               dtype=np.int64)
            keep[np.flatnonzero(long)[prompts >= max_length]] = False
        return ids[keep], {"truncated": int((long & keep).sum()), "dropped_overlong": int((~keep).sum()),
                           "dropped_untrained": 0}

    def _kept_samples(self, ids: np.ndarray, overlong: str) -> tuple[np.ndarray, dict]:
        if self.pairs is not None:
            return self._kept_pairs(ids)
        sizes = self.shards.sizes[ids]
        long = sizes > self.capacity
        if overlong == "drop":
            return ids[~long], {"truncated": 0, "dropped_overlong": int(long.sum()), "dropped_untrained": 0}
        untrained = np.array([not self.shards.mask.get(int(i), 0, self.capacity)[1:].any() for i in ids[long]],
                             dtype=bool)
        keep = np.ones(ids.size, dtype=bool)
        keep[np.flatnonzero(long)[untrained]] = False
        return ids[keep], {"truncated": int(long.sum() - untrained.sum()), "dropped_overlong": 0,
                           "dropped_untrained": int(untrained.sum())}

    def _epoch_rows(self, kept: np.ndarray, lengths: np.ndarray, seed: int, split_id: int,
                    epoch: int) -> tuple[np.ndarray, np.ndarray]:
        order = _rng(seed, split_id, epoch, 0).permutation(kept)
        if not self.pack:
            return np.arange(order.size + 1, dtype=np.int64), order
        offsets, samples = pack_rows(order, lengths, self.capacity)
        counts = np.diff(offsets)
        perm = _rng(seed, split_id, epoch, 1).permutation(counts.size)
        new_offsets = np.zeros_like(offsets)
        np.cumsum(counts[perm], out=new_offsets[1:])
        gather = np.repeat(offsets[:-1][perm] - new_offsets[:-1], counts[perm]) + np.arange(samples.size)
        return new_offsets, samples[gather]

    def _build(self, sample_range: tuple[int, int], seed: int, split_id: int, overlong: str) -> dict:
        ids = np.arange(*sample_range, dtype=np.int64)
        kept, counts = self._kept_samples(ids, overlong)
        lengths = self._sample_lengths()
        offsets, samples, rows_per_epoch, epochs = [np.zeros(1, np.int64)], [], 0, 0
        rows = 0
        while rows < self.num_samples and kept.size:
            epoch_offsets, epoch_samples = self._epoch_rows(kept, lengths, seed, split_id, epochs)
            rows_per_epoch = rows_per_epoch or epoch_offsets.size - 1
            offsets.append(epoch_offsets[1:] + offsets[-1][-1])
            samples.append(epoch_samples)
            rows += epoch_offsets.size - 1
            epochs += 1
        row_offsets = np.concatenate(offsets)[: self.num_samples + 1]
        row_samples = np.concatenate(samples)[: row_offsets[-1]] if samples else np.zeros(0, np.int64)
        stats = {"samples": ids.size, **counts, "rows_per_epoch": rows_per_epoch,
                 "tokens_per_epoch": int(lengths[kept].sum()), "epochs": epochs}
        return {"row_offsets": row_offsets, "row_samples": row_samples,
                "stats": np.asarray([stats[k] for k in STATS], dtype=np.int64)}

    def describe(self) -> str:
        s = self.stats
        if self.pairs is None:
            line = (f"{s['samples']:,} samples, {s['truncated']} truncated, {s['dropped_overlong']} dropped as longer "
                    f"than seq_length + 1, {s['dropped_untrained']} dropped with no trained token left, "
                    f"{s['rows_per_epoch']:,} rows per epoch")
        else:
            line = (f"{s['samples']:,} pairs, {s['truncated']} truncated to max_length {self.pairs.max_length}, "
                    f"{s['dropped_overlong']} dropped as their prompt fills it, {s['rows_per_epoch']:,} "
                    f"{'rows' if self.pack else 'pairs'} per epoch")
        fill = f"{100 * s['packing_efficiency']:.1f}% of row tokens are sample tokens"
        return f"{line}, {fill} ({'packed' if self.pack else 'padded'}), {s['epochs']} epoch(s)"

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        if not -self.num_samples <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range for {self.num_samples} samples")
        i %= self.num_samples
        samples = self.row_samples[self.row_offsets[i]: self.row_offsets[i + 1]]
        if self.pairs is not None and not self.pack:  # one pair: its two sequences, a row each
            rows = [self._row(i, [(int(samples[0]) * PAIR_DOCUMENTS + j, j)]) for j in range(PAIR_DOCUMENTS)]
            item = {key: np.stack([row[key] for row in rows]) for key in rows[0]}
        else:
            documents = self.shards.documents
            item = self._row(i, [(int(sample) * documents + j, k * documents + j)
                                 for k, sample in enumerate(samples) for j in range(documents)])
        if self.pairs is not None:
            item["pair_ids"] = samples.astype(np.int64)
        return item

    def _row(self, i: int, documents: list[tuple[int, int]]) -> dict[str, np.ndarray]:
        """Row ``i`` holding ``documents`` (document, its sequence number in the item) one after another."""
        tokens = np.full(self.capacity, self.pad_id, dtype=np.int64)
        mask = np.zeros(self.capacity, dtype=np.uint8)
        starts = np.zeros(self.capacity, dtype=bool)
        sequence_ids = np.full(self.capacity, -1, dtype=np.int64)
        lengths = self._document_lengths()
        pos = 0
        for document, sequence in documents:
            n = int(lengths[document])
            first = int(self.shards.sizes[document]) - n if self.pairs is not None and self.pairs.keep_end else 0
            tokens[pos: pos + n] = self.shards.tokens.get(document, first, n)
            mask[pos: pos + n] = self.shards.mask.get(document, first, n)
            mask[pos] = 0  # no target crosses into a sample from whatever precedes it
            starts[pos] = True
            sequence_ids[pos: pos + n - 1] = sequence  # the labels (next tokens) of the document's own tokens
            pos += n
        if self.vocab_size is not None and tokens[:pos].max() >= self.vocab_size:
            raise DataError(f"{self.shards.prefix}: row {i} holds token id {int(tokens[:pos].max())}, outside the "
                            f"model's vocab_size {self.vocab_size}; was it preprocessed with another tokenizer?")
        item = {"tokens": tokens, "loss_mask": mask[1:].astype(np.int64)}
        if self.pairs is not None:
            item["sequence_ids"] = sequence_ids[:-1]
        if self.pack:
            starts[pos: pos + 1] = True  # the pad tail is a segment of its own
            item.update(document_positions(starts[:-1]))
        return item


def build_sft_datasets(shards: SFTShards, split: str, seq_length: int, seed: int,
                       num_samples: tuple[int, int, int], cache_dir: str, pack: bool, overlong: str, pad_id: int,
                       vocab_size: int | None, pairs: PairTruncation | None = None) -> tuple:
    """(train, valid, test): the split string cuts the samples (Megatron's rounding); None where nothing is asked
    for or the split has no samples."""
    ranges = split_document_ranges(len(shards), parse_split(split))
    return tuple(
        SFTDataset(shards, split_id, ranges[split_id], seq_length, int(n), seed, cache_dir, pack, overlong,
                   pad_id, vocab_size, pairs)
        if n and ranges[split_id][1] > ranges[split_id][0] else None
        for split_id, n in enumerate(num_samples)
    )
