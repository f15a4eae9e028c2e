"""Inference on a pipeline-parallel model where it lives: :class:`StagedCausalLM`.

A ``PipelineModule`` (DeepSpeed's one block per rank, or :class:`~llama_megatron.model.chunked_pipeline.
ChunkedPipelineModule`'s virtual stages) holds only its stages' layers, and its engine runs it only inside a training
or evaluation schedule of micro-batches with labels. Inference (lm-eval's requests, KV-cache decoding) needs logits
of one batch of any length on every rank, so this runs the stages one after another, in stage order: the owner of
each virtual stage runs its layers (the decoder layers with their KV cache when one is given) and sends the payload
to the next stage's owner; the last stage's owner turns the head's output into this TP rank's vocab shard of the
logits and broadcasts it over the pipeline group. Every rank then holds what ``LlamaCausalLM`` returns at PP 1, so
``generate`` and the lm-eval backend run on it unchanged. No weight moves or is copied: the module is the engine's.

The payload's tensors (hidden states, position ids, an MoE model's router statistics) travel with a header of their
dtypes and shapes, as DeepSpeed's pipeline sends its first one, because a request's length changes from call to
call. Stages run one at a time (no micro-batches to overlap): this is for evaluation, not for throughput.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from llama_megatron.config import ModelConfig
from llama_megatron.model.kv_cache import KVCache
from llama_megatron.model.layers import DecoderLayerPipe
from llama_megatron.model.llama import logits_of
from llama_megatron.parallel.collectives import gather_from_tp_region
from llama_megatron.parallel.context import ParallelContext
from llama_megatron.parallel.degrees import LocalShapes

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.bool)
_MAX_TENSORS, _MAX_DIMS = 6, 4
_HEADER = 2 + _MAX_TENSORS * (2 + _MAX_DIMS)  # bare?, count, then per tensor: dtype, ndim, dims


class StagedCausalLM(nn.Module):
    """``LlamaCausalLM``'s inference interface (``forward``, ``forward_cached``, ``full_logits``, ``config``,
    ``pctx``, ``shapes``) over this rank's stages of ``pipeline``; every rank of the job calls it together."""

    def __init__(self, pipeline: nn.Module, config: ModelConfig, pctx: ParallelContext, shapes: LocalShapes) -> None:
        super().__init__()
        self.pipeline = pipeline  # registered, so parameters(), eval() and train() reach the engine's module
        self.config, self.pctx, self.shapes = config, pctx, shapes
        placement = getattr(pipeline, "placement", None)
        if placement is None:  # DeepSpeed's PipelineModule: stage r is rank r's one block
            self._owners = [(stage, 0) for stage in range(pctx.pp_size)]
            self._chunks = [list(pipeline.forward_funcs)]
        else:
            self._owners = [placement.owner(stage) for stage in range(placement.stages)]
            self._chunks = [list(pipeline.forward_funcs[part]) for part in pipeline.chunk_slices]

    def _global(self, pipe_rank: int) -> int:
        """The global rank of pipeline rank ``pipe_rank`` in this rank's pipeline group (same TP and data ranks)."""
        return dist.get_global_rank(self.pctx.pp_group, pipe_rank)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's vocab shard of the logits of ``input_ids`` (every rank passes the same ids)."""
        return self._run(input_ids, position_ids, None)

    @torch.no_grad()
    def forward_cached(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """As ``LlamaCausalLM.forward_cached``: each stage's decoder layers read and extend their layers of
        ``cache`` (every rank holds a cache of all layers; only its own stages' layers are filled)."""
        return self._run(input_ids, position_ids, cache)

    def full_logits(self, local_logits: torch.Tensor) -> torch.Tensor:
        """Gather the vocab shards and drop the padding."""
        return gather_from_tp_region(local_logits, self.pctx)[..., : self.config.vocab_size]

    def _run(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None, cache: KVCache | None) -> torch.Tensor:
        if position_ids is None:
            seq = input_ids.shape[1]
            position_ids = torch.arange(seq, device=input_ids.device).expand(input_ids.shape[0], seq)
        me = self.pctx.pp_rank
        payload: torch.Tensor | tuple = (input_ids, position_ids)
        last = len(self._owners) - 1
        for stage, (owner, chunk) in enumerate(self._owners):
            if owner != me:
                continue
            if stage > 0 and self._owners[stage - 1][0] != me:
                payload = _receive(self._global(self._owners[stage - 1][0]), input_ids.device)
            for fn in self._chunks[chunk]:
                if cache is not None and isinstance(fn, DecoderLayerPipe):
                    payload = fn(payload, kv_cache=cache.layers[fn.layer_number])
                else:
                    payload = fn(payload)
            if stage < last and self._owners[stage + 1][0] != me:
                _send(payload, self._global(self._owners[stage + 1][0]))
        source = self._owners[last][0]
        logits = logits_of(payload) if source == me else None
        return _broadcast(logits, self._global(source), self.pctx.pp_group, input_ids.device)


def _header(payload: torch.Tensor | tuple, device: torch.device) -> torch.Tensor:
    tensors = (payload,) if isinstance(payload, torch.Tensor) else tuple(payload)
    if len(tensors) > _MAX_TENSORS or any(t.dim() > _MAX_DIMS for t in tensors):
        raise ValueError(f"a stage payload of {len(tensors)} tensors of dims {[t.dim() for t in tensors]} does not "
                         f"fit the header ({_MAX_TENSORS} tensors of {_MAX_DIMS} dims at most)")
    header = [int(isinstance(payload, torch.Tensor)), len(tensors)]
    for t in tensors:
        header += [_DTYPES.index(t.dtype), t.dim(), *t.shape, *[0] * (_MAX_DIMS - t.dim())]
    return torch.tensor(header + [0] * (_HEADER - len(header)), dtype=torch.long, device=device)


def _empty_payload(header: torch.Tensor, device: torch.device) -> tuple[bool, list[torch.Tensor]]:
    values = header.tolist()
    bare, count = bool(values[0]), values[1]
    tensors = []
    for i in range(count):
        dtype, ndim, *dims = values[2 + i * (2 + _MAX_DIMS): 2 + (i + 1) * (2 + _MAX_DIMS)]
        tensors.append(torch.empty(dims[:ndim], dtype=_DTYPES[dtype], device=device))
    return bare, tensors


def _send(payload: torch.Tensor | tuple, dst: int) -> None:
    tensors = (payload,) if isinstance(payload, torch.Tensor) else tuple(payload)
    dist.send(_header(payload, tensors[0].device), dst)
    for t in tensors:
        dist.send(t.contiguous(), dst)


def _receive(src: int, device: torch.device) -> torch.Tensor | tuple:
    header = torch.empty(_HEADER, dtype=torch.long, device=device)
    dist.recv(header, src)
    bare, tensors = _empty_payload(header, device)
    for t in tensors:
        dist.recv(t, src)
    return tensors[0] if bare else tuple(tensors)


def _broadcast(tensor: torch.Tensor | None, src: int, group, device: torch.device) -> torch.Tensor:
    """``tensor`` from global rank ``src`` on every rank of ``group`` (None where it is not the source)."""
    header = _header(tensor, device) if tensor is not None else torch.empty(_HEADER, dtype=torch.long, device=device)
    dist.broadcast(header, src, group=group)
    if tensor is None:
        tensor = _empty_payload(header, device)[1][0]
    else:
        tensor = tensor.contiguous()
    dist.broadcast(tensor, src, group=group)
    return tensor
