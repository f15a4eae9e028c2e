"""Random-token samples with the real datasets' item interface, for runs before real data is configured.

Each sample is drawn from its own seeded stream (seed, split, index), so items are identical whatever order or
rank asks for them: resume and data-parallel slicing behave exactly as with real data.
"""

from __future__ import annotations

import numpy as np

from llama_megatron.errors import ConfigError


class SyntheticDataset:
    def __init__(
        self,
        num_samples: int,
        seq_length: int,
        vocab_size: int,
        seed: int,
        split_id: int = 0,
        per_document_attention: bool = False,
    ) -> None:
        if vocab_size < 1 or seq_length < 1 or num_samples < 0:
            raise ConfigError("synthetic data needs vocab_size >= 1, seq_length >= 1 and num_samples >= 0")
        self.num_samples = num_samples
        self.seq_length = seq_length
        self.vocab_size = vocab_size
        self.seed = seed
        self.split_id = split_id
        self.per_document_attention = per_document_attention

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        if not -self.num_samples <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range for {self.num_samples} samples")
        i %= self.num_samples
        rng = np.random.default_rng(np.random.SeedSequence([self.seed, self.split_id, i]))
        item = {"tokens": rng.integers(0, self.vocab_size, self.seq_length + 1, dtype=np.int64)}
        if self.per_document_attention:  # one document per sample
            item["position_ids"] = np.arange(self.seq_length, dtype=np.int64)
            item["segment_ids"] = np.zeros(self.seq_length, dtype=np.int64)
        return item
