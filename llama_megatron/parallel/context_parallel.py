"""Context parallelism (CP): DeepSpeed-Ulysses attention over the CP group, and which tokens a CP rank holds.

Every CP rank holds one contiguous shard of s / CP tokens of each sample (rank c: tokens [c s / CP, (c + 1) s / CP))
through the whole model: embedding, norms, MLP, loss, and the pipeline payload between stages (cut again over TP
under sequence parallelism). Only attention needs the whole sequence: DeepSpeed's ``DistributedAttention``
all-to-alls q, k and v from [b, s / CP, heads, d] to [b, s, heads / CP, d] (each rank: every token, 1/CP of this TP
rank's heads), runs the local attention kernel on full sequences, and all-to-alls the output back. Because the
all-to-all reassembles the shards in rank order, the local kernel sees the sequence in its natural order: plain
causal masks, per-document masks from the full-length ``segment_ids`` and flash-attn varlen all apply unchanged.

Load balance: every rank attends over the full sequence for the same number of heads, and the rest of the layer
costs the same for any equal split of the tokens, so a contiguous split is balanced. (Zig-zag splitting, which
ring attention needs because there a rank's causal work depends on where its queries sit, buys nothing here.)
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from llama_megatron.parallel.context import ParallelContext

SEQ_DIM, HEAD_DIM = 1, 2  # q, k, v are [batch, seq, heads, head_dim]


def context_shard(x: torch.Tensor, rank: int, size: int, dim: int = SEQ_DIM) -> torch.Tensor:
    """CP rank ``rank``'s contiguous shard of a full-length tensor along ``dim``."""
    if size == 1:
        return x
    if x.shape[dim] % size:
        raise ValueError(f"sequence length {x.shape[dim]} is not divisible by context parallel size {size}")
    return x.chunk(size, dim=dim)[rank]


class UlyssesAttention(nn.Module):
    """``local_attention(q, k, v, segment_ids)`` on full sequences through DeepSpeed's ``DistributedAttention``.

    q [b, s / CP, heads, d] and k, v [b, s / CP, kv_heads, d] of this rank's tokens (TP rank's heads, already
    rotated with their true positions) -> [b, s / CP, heads, d]. ``segment_ids`` are full length [b, s]. KV heads
    are repeated ``kv_repeats`` times first when they do not split evenly over CP
    (:func:`llama_megatron.parallel.degrees.kv_head_repeats`, in :class:`llama_megatron.parallel.degrees.LocalShapes`).
    """

    def __init__(self, local_attention: Callable, pctx: ParallelContext, kv_repeats: int) -> None:
        super().__init__()
        from deepspeed.sequence.layer import DistributedAttention

        self.repeats = kv_repeats
        self.ulysses = DistributedAttention(local_attention, pctx.cp_group, scatter_idx=HEAD_DIM, gather_idx=SEQ_DIM)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segment_ids: torch.Tensor | None,
                window: int | None = None) -> torch.Tensor:
        if self.repeats > 1:
            k = k.repeat_interleave(self.repeats, dim=HEAD_DIM)
            v = v.repeat_interleave(self.repeats, dim=HEAD_DIM)
        # batch_dim_idx 0, no rotary inside (q and k are rotated already); segment_ids and the sliding window go to
        # the local kernel, which sees whole sequences, so a window applies as it would in one process
        return self.ulysses(q, k, v, 0, None, segment_ids, window)
