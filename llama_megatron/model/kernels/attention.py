"""Causal self-attention kernels: q [b, s, heads, d], k/v [b, s, kv_heads, d] -> [b, s, heads, d].

``segment_ids`` (document index per token, or None) restricts attention to each packed document; ``window`` (a
layer's sliding window, or None) to the last ``window`` positions up to and including the query's own, as
transformers' ``sliding_window`` (query i sees keys j with i - window < j <= i). Whatever a
kernel derives from it (a dense mask, a FlexAttention block mask, flash-attn's cumulative lengths) is built once
per micro batch and shared by every layer of the stage (:mod:`llama_megatron.model.batch_cache`); under
pipeline parallelism each stage rebuilds it from the ids that travel with the hidden states.
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch
import torch.nn.functional as F

from llama_megatron.model.batch_cache import per_micro_batch

try:  # pragma: no cover - CUDA only
    from flash_attn import flash_attn_func, flash_attn_varlen_func

    HAVE_FLASH_ATTN = True
except Exception:  # ImportError, or a broken CUDA build
    HAVE_FLASH_ATTN = False


def causal_mask(queries: int, keys: int, window: int | None, device: torch.device) -> torch.Tensor:
    """Boolean [queries, keys] mask of the last ``queries`` positions of ``keys``: causal, and within ``window``."""
    mask = torch.ones(queries, keys, dtype=torch.bool, device=device).tril(diagonal=keys - queries)
    return mask if window is None else mask.triu(diagonal=keys - queries - window + 1)


def document_causal_mask(segment_ids: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """Boolean [batch, 1, seq, seq] mask: causal (within ``window``) and within the same document."""
    seq = segment_ids.shape[-1]
    same_doc = segment_ids.unsqueeze(-1) == segment_ids.unsqueeze(-2)
    return (same_doc & causal_mask(seq, seq, window, segment_ids.device)).unsqueeze(1)


def chunk_segment_ids(segment_ids: torch.Tensor | None, position_ids: torch.Tensor, chunk: int) -> torch.Tensor:
    """Chunked attention (Llama 4) as per-document attention: a query sees the keys of its own chunk of
    ``chunk`` positions up to itself, so the chunks (of each document, counted by the document's positions) are the
    documents of this [b, s] id tensor. Every kernel's document path runs it (flash-attn varlen, FlexAttention,
    the dense mask); built once per micro batch."""
    def compute() -> torch.Tensor:
        block = torch.div(position_ids, chunk, rounding_mode="floor")
        starts = torch.zeros_like(block, dtype=torch.bool)
        starts[:, 1:] = block[:, 1:] != block[:, :-1]
        if segment_ids is not None:
            starts[:, 1:] |= segment_ids[:, 1:] != segment_ids[:, :-1]
        return starts.cumsum(dim=-1)

    tensors = (position_ids,) if segment_ids is None else (position_ids, segment_ids)
    return per_micro_batch(("chunk-segments", chunk), tensors, compute)


def cu_seqlens(segment_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Cumulative lengths of the documents of every row, flattened (flash-attn varlen input), and the longest."""
    batch, seq = segment_ids.shape
    starts = torch.ones_like(segment_ids, dtype=torch.bool)
    starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    start_positions = starts.flatten().nonzero().flatten()
    ends = torch.cat([start_positions[1:], start_positions.new_tensor([batch * seq])])
    cu = torch.cat([start_positions.new_zeros(1), ends]).to(torch.int32)
    max_len = int((ends - start_positions).max())
    return cu, max_len


@functools.cache
def _cpu_flash_packs_below_its_isa() -> bool:
    """Whether torch's CPU flash attention would pack reduced-precision operands for AMX that ATen then refuses to
    pack. It packs when oneDNN can use AMX (the hardware has it, ``ONEDNN_MAX_CPU_ISA`` allows it), and the packing
    is ATen's own kernel, which refuses below AVX-512: under ``ATEN_CPU_CAPABILITY=avx2`` (or ``default``) on an AMX
    Xeon every bf16 attention over 64 tokens or more raised "pack_vnni2 is only supported when avx512 is supported"
    (torch 2.13; transformers' SDPA attention too)."""
    onednn_isa = os.environ.get("ONEDNN_MAX_CPU_ISA", os.environ.get("DNNL_MAX_CPU_ISA", "ALL")).upper()
    return (torch.backends.cpu.get_cpu_capability() in ("DEFAULT", "AVX2") and torch.cpu._is_amx_tile_supported()
            and (onednn_isa == "ALL" or "AMX" in onednn_isa))


def sdpa_backend(q: torch.Tensor) -> contextlib.AbstractContextManager:
    """The context every SDPA call of ours runs in. Where the CPU flash kernel would fail
    (:func:`_cpu_flash_packs_below_its_isa`), oneDNN is off for the call: the kernel then asks no AMX packing and
    runs as on a CPU without AMX (the same kernel, the same saved tensors; its backward packs nothing)."""
    if q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16) and _cpu_flash_packs_below_its_isa():
        return torch.backends.mkldnn.flags(enabled=False)
    return contextlib.nullcontext()


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, enable_gqa: bool,
          causal: bool = True) -> torch.Tensor:
    """SDPA on [b, s, heads, d] tensors: ``mask`` if given, else causal (``causal``) or over every key, in
    :func:`sdpa_backend`."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    with sdpa_backend(q):
        if mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=enable_gqa)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=enable_gqa)
    return out.transpose(1, 2)


def _dense_mask(segment_ids: torch.Tensor | None, seq: int, window: int | None,
                device: torch.device) -> torch.Tensor | None:
    """The mask SDPA needs: None for plain causal attention, else document and/or window mask (built once per micro
    batch and window, shared by the stage's layers)."""
    window = _windowed(window, seq)
    if segment_ids is None:
        if window is None:
            return None
        return per_micro_batch(("window-mask", window, seq, str(device)), (),
                               lambda: causal_mask(seq, seq, window, device))
    return per_micro_batch(f"dense-document-mask-{window}", (segment_ids,),
                           lambda: document_causal_mask(segment_ids, window))


def _windowed(window: int | None, seq: int) -> int | None:
    """``window``, or None where it covers the whole sequence (nothing to mask)."""
    return None if window is None or window >= seq else window


class ReferenceAttention:
    """HF's sdpa path: K/V heads repeated for GQA, a dense block-diagonal causal mask for packed documents."""

    name = "sdpa, K/V repeated, dense document mask"

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segment_ids: torch.Tensor | None,
                 window: int | None = None) -> torch.Tensor:
        groups = q.shape[2] // k.shape[2]
        if groups > 1:
            k = k.repeat_interleave(groups, dim=2)
            v = v.repeat_interleave(groups, dim=2)
        return _sdpa(q, k, v, _dense_mask(segment_ids, q.shape[1], window, q.device), enable_gqa=False)

    def after(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None = None,
              chunk: int | None = None, first_key: int = 0) -> torch.Tensor:
        """The last ``q.shape[1]`` positions of a sequence attending to its keys (cached decoding): keys of positions
        ``first_key`` onwards (a chunked layer's cache holds its current chunk only)."""
        groups = q.shape[2] // k.shape[2]
        if groups > 1:
            k = k.repeat_interleave(groups, dim=2)
            v = v.repeat_interleave(groups, dim=2)
        return _sdpa(q, k, v, _trailing_causal_mask(q, k, window, chunk, first_key), enable_gqa=False, causal=False)


def fast_attention_route(device_type: str, dtype: torch.dtype, packed: bool, have_flash: bool = HAVE_FLASH_ATTN) -> str:
    """The kernel :class:`FastAttention` runs for inputs on ``device_type`` of ``dtype``.

    ``flash`` (flash-attn, dense or varlen) for CUDA fp16/bf16 when installed; ``sdpa-causal`` without documents;
    for packed documents ``flex`` (compiled FlexAttention, document block mask) on CUDA and ``sdpa-dense-mask``
    everywhere else. FlexAttention never runs on CPU: torch 2.13's compiled ``flex_attention`` returns wrong values
    there on AVX2-only CPUs (observed 2.8 off at sequence 24 and NaN at 56, head_dim 8, on an AMD EPYC without AVX-512; eager is right), and the
    eager fallback is 7-8x slower than SDPA with the dense mask (``benchmarks/cpu_document_attention.py``).
    """
    if have_flash and device_type == "cuda" and dtype in (torch.float16, torch.bfloat16):
        return "flash"
    if not packed:
        return "sdpa-causal"
    return "flex" if device_type == "cuda" else "sdpa-dense-mask"


class FastAttention:
    """No K/V copies for GQA; packed documents without a dense [s, s] mask on CUDA (:func:`fast_attention_route`)."""

    name = "flash-attn (varlen for documents) | sdpa enable_gqa + FlexAttention document block mask (CUDA) " \
           "or dense document mask (CPU)"

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segment_ids: torch.Tensor | None,
                 window: int | None = None) -> torch.Tensor:
        window = _windowed(window, q.shape[1])
        route = fast_attention_route(q.device.type, q.dtype, segment_ids is not None or window is not None)
        if route == "flash":  # pragma: no cover - CUDA only
            return _flash(q, k, v, segment_ids, window)
        if route == "sdpa-causal":
            return _sdpa(q, k, v, None, enable_gqa=True)
        if route == "flex":  # pragma: no cover - CUDA only
            return _flex(q, k, v, segment_ids, window)
        return _sdpa(q, k, v, _dense_mask(segment_ids, q.shape[1], window, q.device), enable_gqa=True)

    def after(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None = None,
              chunk: int | None = None, first_key: int = 0) -> torch.Tensor:
        """As :meth:`ReferenceAttention.after`, without K/V copies."""
        return _sdpa(q, k, v, _trailing_causal_mask(q, k, window, chunk, first_key), enable_gqa=True, causal=False)


def _trailing_causal_mask(q: torch.Tensor, k: torch.Tensor, window: int | None, chunk: int | None = None,
                          first_key: int = 0) -> torch.Tensor | None:
    """Query i (of the last sq positions of sk) sees keys up to sk - sq + i (and, with ``window``, from
    sk - sq + i - window + 1; with ``chunk``, from the start of its chunk: keys are positions first_key ..
    first_key + sk - 1, first_key the start of a chunk); None when that is every key."""
    sq, sk = q.shape[1], k.shape[1]
    window = _windowed(window, sk)
    chunk = None if chunk is None or chunk >= sk else chunk  # sk keys from a chunk's start: all in that chunk
    if sq == 1 and window is None and chunk is None:
        return None
    mask = causal_mask(sq, sk, window, q.device)
    if chunk is not None:
        keys = (first_key + torch.arange(sk, device=q.device)) // chunk
        mask = mask & (keys[sk - sq:].unsqueeze(1) == keys.unsqueeze(0))
    return mask


def _flash(q, k, v, segment_ids, window):  # pragma: no cover - CUDA only
    # flash-attn's window (left, right) counts the keys besides the query's own: HF's window - 1
    window_size = (-1, -1) if window is None else (window - 1, 0)
    if segment_ids is None:
        return flash_attn_func(q, k, v, causal=True, window_size=window_size)
    b, s = segment_ids.shape
    cu, max_len = per_micro_batch("cu-seqlens", (segment_ids,), lambda: cu_seqlens(segment_ids))
    out = flash_attn_varlen_func(q.reshape(b * s, *q.shape[2:]), k.reshape(b * s, *k.shape[2:]),
                                 v.reshape(b * s, *v.shape[2:]), cu, cu, max_len, max_len, causal=True,
                                 window_size=window_size)
    return out.view(b, s, *out.shape[1:])


_compiled_flex = None


def _flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segment_ids: torch.Tensor | None,
          window: int | None) -> torch.Tensor:
    from torch.nn.attention.flex_attention import flex_attention

    global _compiled_flex
    if _compiled_flex is None:  # FlexAttention is only fast compiled (eager runs a dense reference)
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    if segment_ids is None:  # a window alone: every token in one document
        segment_ids = per_micro_batch(("one-document", *q.shape[:2], str(q.device)), (),
                                      lambda: torch.zeros(q.shape[:2], dtype=torch.long, device=q.device))
    block_mask = per_micro_batch(f"flex-document-mask-{window}", (segment_ids,),
                                 lambda: document_block_mask(segment_ids, window))
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    return _compiled_flex(q, k, v, block_mask=block_mask, enable_gqa=True).transpose(1, 2)


def document_block_mask(segment_ids: torch.Tensor, window: int | None = None):
    """FlexAttention BlockMask: causal (within ``window``) within each document (compiled on CUDA, so no [s, s]
    mask is made; eager elsewhere, where only the tests build it)."""
    from torch.nn.attention.flex_attention import create_block_mask

    def same_document_causal(b, h, q_idx, kv_idx):
        visible = (segment_ids[b, q_idx] == segment_ids[b, kv_idx]) & (kv_idx <= q_idx)
        return visible if window is None else visible & (q_idx - kv_idx < window)

    batch, seq = segment_ids.shape
    return create_block_mask(same_document_causal, batch, None, seq, seq, device=segment_ids.device,
                             _compile=segment_ids.is_cuda)
