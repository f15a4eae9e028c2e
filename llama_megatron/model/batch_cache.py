"""Values derived once per micro batch and shared by every decoder layer of a stage.

RoPE's cos/sin and the attention's document mask depend only on a micro batch's ``position_ids`` and
``segment_ids``, which travel unchanged through the payload of every layer (and, under pipeline parallelism,
arrive as fresh tensors at each stage). HF computes them once per forward and hands them to the layers; here the
layers stay free of that plumbing and ask :func:`per_micro_batch`, which computes the value on the first layer
and returns the same object to the others (and to activation recomputation).

The key is the identity and version counter of the id tensors, checked through weak references: a hit needs the
very same live tensor, unmodified, so a reused buffer (in-place receive, new version) or a new micro batch never
sees a stale value, and an entry dies with its micro batch.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

import torch

_MAX_ENTRIES = 16  # micro batches alive at once in one stage (1F1B keeps at most PP in flight), with room
_entries: OrderedDict[tuple, tuple[list[weakref.ref], Any]] = OrderedDict()


def per_micro_batch(tag: Hashable, tensors: tuple[torch.Tensor, ...], compute: Callable[[], Any]) -> Any:
    """``compute()``, or its value from an earlier call with the same ``tag`` and the same live ``tensors``."""
    key = (tag, *((id(t), t._version) for t in tensors))
    hit = _entries.get(key)
    if hit is not None and all(ref() is t for ref, t in zip(hit[0], tensors)):
        _entries.move_to_end(key)
        return hit[1]
    value = compute()
    _entries[key] = ([weakref.ref(t) for t in tensors], value)
    _entries.move_to_end(key)
    for stale in [k for k, (refs, _) in _entries.items() if any(r() is None for r in refs)]:
        del _entries[stale]
    while len(_entries) > _MAX_ENTRIES:
        _entries.popitem(last=False)
    return value
