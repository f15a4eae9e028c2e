"""Several datasets mixed by weight with Megatron's greedy blending index (cached like the sample indexes)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from llama_megatron.data.index_cache import cached_arrays
from llama_megatron.data.sample_index import build_blending_index
from llama_megatron.errors import ConfigError


class BlendedDataset:
    """``ds[i]`` is sample ``within[i]`` of dataset ``which[i]``; the item dict also says ``dataset_id``."""

    def __init__(self, datasets: Sequence, weights: Sequence[float], size: int, cache_dir: str) -> None:
        if len(datasets) != len(weights) or not datasets:
            raise ConfigError("a blend needs one weight per dataset")
        total = float(sum(weights))
        self.datasets = list(datasets)
        self.weights = [float(w) / total for w in weights]
        self.size = int(size)
        description = {"kind": "blend", "version": 1, "weights": self.weights, "size": self.size}

        def build() -> dict[str, np.ndarray]:
            which, within = build_blending_index(self.weights, self.size)
            return {"which": which, "within": within}

        arrays = cached_arrays(cache_dir, "blend", description, build)
        self.which, self.within = arrays["which"], arrays["within"]
        for d, ds in enumerate(self.datasets):
            used = int(np.count_nonzero(self.which == d))
            if used > len(ds):
                raise ConfigError(f"blend component {d} has {len(ds)} samples, the blend needs {used}")

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        if not -self.size <= i < self.size:
            raise IndexError(f"sample {i} out of range for {self.size} samples")
        d = int(self.which[i])
        item = dict(self.datasets[d][int(self.within[i])])
        item["dataset_id"] = np.int64(d)
        return item
