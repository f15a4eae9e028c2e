"""Parameters that DeepSpeed's ZeRO-3 partitioned as they were made (``deepspeed.zero.Init``).

Such a parameter holds no full tensor: ``param.data`` is empty, ``param.ds_tensor`` is this rank's contiguous
slice of the flattened parameter (padded at the end so that every rank of ``param.ds_process_group`` holds the same
number of elements: rank r holds elements r x n .. (r + 1) x n - 1, DeepSpeed's own layout), ``param.ds_shape``
its full shape. Filling one (a seeded initial tensor, a tensor read from a checkpoint) means copying that slice of
the full tensor: every rank computes or reads the same full tensor, so no communication is needed, and the model is
never whole in memory. An ordinary parameter is copied whole.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def is_partitioned(param: torch.nn.Parameter) -> bool:
    return getattr(param, "ds_tensor", None) is not None and hasattr(param, "ds_shape")


def full_shape(param: torch.nn.Parameter) -> tuple[int, ...]:
    """The parameter's shape on this TP rank, partitioned or not."""
    return tuple(param.ds_shape) if is_partitioned(param) else tuple(param.shape)


@torch.no_grad()
def copy_into(param: torch.nn.Parameter, tensor: torch.Tensor) -> None:
    """``param`` = ``tensor`` (its full shape on this TP rank), converted to the parameter's dtype; for a
    partitioned parameter only this rank's slice is written."""
    if not is_partitioned(param):
        param.copy_(tensor.to(param.dtype))
        return
    part = param.ds_tensor
    size = part.ds_numel
    start = dist.get_rank(group=param.ds_process_group) * size
    flat = tensor.reshape(-1)[start:start + size]
    part.data[:flat.numel()].copy_(flat.to(part.dtype))
    part.data[flat.numel():].zero_()  # the padding of the last rank
