"""First-fit packing of whole samples into fixed-size rows (pure index arithmetic, no tokens).

Samples are taken in the given (shuffled) order; each goes into the first row, in order of creation, with room
for it, else opens a new row. To keep the cost linear in the number of samples, first-fit runs over consecutive
windows of ``window`` samples: rows of different windows are never merged (a window holds thousands of rows, so
what this gives up is a fraction of one row per window).
"""

from __future__ import annotations

import numpy as np

PACK_WINDOW = 10_000


def first_fit(lengths: np.ndarray, capacity: int) -> np.ndarray:
    """Row index of every sample (rows numbered in order of creation); every length must be <= capacity."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size and (lengths.max() > capacity or lengths.min() < 1):
        raise ValueError(f"lengths must lie in 1..{capacity}")
    room = np.empty(lengths.size, dtype=np.int64)
    rows = np.empty(lengths.size, dtype=np.int64)
    opened = 0
    for i, length in enumerate(lengths.tolist()):
        fits = np.flatnonzero(room[:opened] >= length)
        if fits.size:
            row = int(fits[0])
        else:
            row, opened = opened, opened + 1
            room[row] = capacity
        room[row] -= length
        rows[i] = row
    return rows


def pack_rows(order: np.ndarray, lengths: np.ndarray, capacity: int,
              window: int = PACK_WINDOW) -> tuple[np.ndarray, np.ndarray]:
    """(row_offsets int64[R + 1], row_samples): the samples ``order`` (ids) packed first-fit, windowed.

    Row r holds samples ``row_samples[row_offsets[r]:row_offsets[r + 1]]``, in the order they were placed.
    """
    pieces, counts = [], []
    for lo in range(0, order.size, window):
        ids = order[lo: lo + window]
        rows = first_fit(lengths[ids], capacity)
        by_row = np.argsort(rows, kind="stable")
        pieces.append(ids[by_row])
        counts.append(np.bincount(rows))
    row_samples = np.concatenate(pieces) if pieces else np.zeros(0, np.int64)
    offsets = np.zeros(sum(c.size for c in counts) + 1, dtype=np.int64)
    if counts:
        np.cumsum(np.concatenate(counts), out=offsets[1:])
    return offsets, row_samples
