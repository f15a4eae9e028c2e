"""Which samples each data-parallel rank reads, resumable at an exact consumed-sample count.

Megatron's MegatronPretrainingSampler order: the global batch order is the dataset order; every run of
``micro_batch * dp_size`` consecutive samples is cut into ``dp_size`` contiguous slices and rank r takes slice r.
Resuming from ``consumed_samples`` (a multiple of ``micro_batch * dp_size`` at a step boundary) continues
exactly where the interrupted run stopped, as long as the dataset (seed, num_samples) is the same.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from llama_megatron.errors import ConfigError


class PretrainingSampler:
    """Iterates lists of dataset indices, one list per micro batch of this rank."""

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
        drop_last: bool = True,
    ) -> None:
        if micro_batch_size < 1 or dp_size < 1:
            raise ConfigError("micro_batch_size and dp_size must be >= 1")
        if not 0 <= dp_rank < dp_size:
            raise ConfigError(f"dp_rank {dp_rank} outside 0..{dp_size - 1}")
        if not 0 <= consumed_samples <= total_samples:
            raise ConfigError(
                f"consumed_samples {consumed_samples} outside 0..{total_samples} (dataset size)"
            )
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.drop_last = drop_last

    def __len__(self) -> int:
        chunk = self.micro_batch_size * self.dp_size
        remaining = self.total_samples - self.consumed_samples
        full, rest = divmod(remaining, chunk)
        return full + (1 if rest > self.dp_rank * self.micro_batch_size and not self.drop_last else 0)

    def __iter__(self) -> Iterator[list[int]]:
        chunk = self.micro_batch_size * self.dp_size
        lo = self.dp_rank * self.micro_batch_size
        start = self.consumed_samples
        while start + chunk <= self.total_samples:
            yield list(range(start + lo, start + lo + self.micro_batch_size))
            start += chunk
        if not self.drop_last and start + lo < self.total_samples:
            yield list(range(start + lo, min(start + lo + self.micro_batch_size, self.total_samples)))


def make_sample_iterator(
    dataset: Sequence,
    consumed_samples: int,
    micro_batch: int,
    dp_rank: int,
    dp_size: int,
    drop_last: bool = True,
) -> Iterator[list[int]]:
    return iter(PretrainingSampler(len(dataset), consumed_samples, micro_batch, dp_rank, dp_size, drop_last))


def collate(items: Sequence[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Stack the per-sample arrays of a micro batch (``torch.from_numpy`` them on the training side)."""
    return {key: np.stack([item[key] for item in items]) for key in items[0]}
