"""Pure index arithmetic for GPT pretraining samples: splits, packing, shuffling, blending.

Semantics follow Megatron-LM's GPTDataset and BlendableDataset so runs are comparable:
- the split string ("969,30,1") partitions *documents*, with Megatron's rounding, so no sample crosses splits;
- ``doc_idx`` lists the split's documents once per epoch, each epoch shuffled on its own (a partial last epoch
  then never favours documents that an all-epochs shuffle would repeat);
- sample ``j`` is the packed stream's tokens ``[j*seq, (j+1)*seq]`` (seq+1 tokens; consecutive samples share
  one token, the last label of one is the first input of the next), stored as (position in doc_idx, offset);
- ``shuffle_idx`` permutes the samples; blending picks, for every sample, the dataset furthest behind its
  weight (Megatron's greedy rule), so every prefix of the blend is within one sample of the exact proportions.
"""

from __future__ import annotations

import numpy as np

from llama_megatron.errors import ConfigError


def parse_split(split: str) -> list[float]:
    """Split string like "969,30,1" (or "98/2/0") -> three fractions summing to 1; missing parts are 0."""
    text = str(split).replace("/", ",")
    try:
        parts = [float(p) for p in text.split(",")]
    except ValueError:
        raise ConfigError(f"data.split {split!r} is not like '969,30,1'") from None
    if len(parts) > 3 or any(p < 0 or p != p for p in parts) or sum(parts) <= 0:
        raise ConfigError(f"data.split {split!r}: at most three non-negative weights with a positive sum")
    parts += [0.0] * (3 - len(parts))
    total = sum(parts)
    return [p / total for p in parts]


def split_document_ranges(num_documents: int, fractions: list[float]) -> list[tuple[int, int]]:
    """[start, end) document ranges of train/valid/test, rounded exactly as Megatron's get_split_index."""
    bounds = [0]
    for frac in fractions:
        bounds.append(bounds[-1] + int(round(frac * float(num_documents))))
    diff = bounds[-1] - num_documents
    bounds = [bounds[0]] + [b - diff for b in bounds[1:]]
    bounds = [min(max(b, 0), num_documents) for b in bounds]
    return [(bounds[i], bounds[i + 1]) for i in range(3)]


def _rng(seed: int, *stream: int) -> np.random.Generator:
    # Independent, reproducible streams per (seed, split, epoch, purpose); PCG64 via SeedSequence.
    return np.random.default_rng(np.random.SeedSequence([seed, *stream]))


def num_epochs_needed(tokens_per_epoch: int, seq_length: int, num_samples: int) -> int:
    """Fewest epochs whose tokens give ``num_samples`` samples of ``seq_length + 1`` (sharing one token)."""
    if tokens_per_epoch <= 0:
        raise ConfigError("the split has no tokens")
    needed = num_samples * seq_length + 1
    return max(1, -(-needed // tokens_per_epoch))


def build_doc_idx(documents: np.ndarray, num_epochs: int, seed: int, split_id: int) -> np.ndarray:
    dtype = np.int32 if documents.size == 0 or documents.max() < np.iinfo(np.int32).max else np.int64
    epochs = [
        _rng(seed, split_id, epoch, 0).permutation(documents).astype(dtype) for epoch in range(num_epochs)
    ]
    return np.concatenate(epochs)


def build_sample_idx(
    doc_sizes: np.ndarray, doc_idx: np.ndarray, seq_length: int, num_samples: int
) -> np.ndarray:
    """int64[num_samples + 1, 2]: (position in doc_idx, token offset) where each sample starts.

    Sample j runs from entry j to entry j+1 inclusive. A boundary that falls exactly at a document end points
    at offset 0 of the next non-empty document (empty documents are skipped).
    """
    lengths = doc_sizes[doc_idx].astype(np.int64)
    ends = np.cumsum(lengths)
    if ends.size == 0 or ends[-1] < num_samples * seq_length + 1:
        raise ConfigError("not enough tokens for the requested samples")
    starts_in_stream = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    pos = np.searchsorted(ends, starts_in_stream, side="right")
    offset = starts_in_stream - (ends[pos] - lengths[pos])
    return np.stack([pos, offset], axis=1)


def build_shuffle_idx(num_samples: int, seed: int, split_id: int) -> np.ndarray:
    dtype = np.int32 if num_samples < np.iinfo(np.int32).max else np.int64
    return _rng(seed, split_id, 0, 1).permutation(num_samples).astype(dtype)


def build_blending_index(weights: list[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """Megatron's greedy blend: sample i goes to argmax_d(w_d * max(i, 1) - taken_d), first index on ties.

    Returns (dataset index per sample, sample index within that dataset). A plain loop: it runs once per
    configuration (cached on disk) at about 0.6 s per million samples.
    """
    w = [float(x) for x in weights]
    n = len(w)
    taken = [0] * n
    which = np.empty(size, dtype=np.int16)
    within = np.empty(size, dtype=np.int64)
    which_list = [0] * size
    for i in range(size):
        x = float(i) if i > 1 else 1.0
        best, best_err = 0, w[0] * x - taken[0]
        for d in range(1, n):
            err = w[d] * x - taken[d]
            if err > best_err:
                best, best_err = d, err
        which_list[i] = best
        taken[best] += 1
    which[:] = which_list
    # The k-th time dataset d is picked it serves its sample k.
    for d in range(n):
        mask = which == d
        within[mask] = np.arange(int(mask.sum()), dtype=np.int64)
    return which, within
