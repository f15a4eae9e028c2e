"""Every fast kernel against the reference kernels, forward and backward, on CPU (CUDA-only kernels: tests/gpu).

Tolerances: fp32 1e-5 relative (compiled code and chunked sums reorder floating-point operations; observed
differences are ~1e-7); bf16 2e-2 relative with 1e-2 absolute (bf16 has 8 bits of mantissa: one rounding of a
value of magnitude 1 is 4e-3). The whole model with the fast kernels must match transformers' LlamaForCausalLM
as the reference path does (logits 1e-4, gradients 1e-4 relative), at TP1 and TP2 with SP on and off.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from dist_utils import run_distributed
from test_model_parity import CASES, check_parity

from llama_megatron.errors import ConfigError
from llama_megatron.model.kernels import REFERENCE, resolve_kernels
from llama_megatron.model.kernels import reference as ref_ops
from llama_megatron.model.kernels.attention import (
    FastAttention,
    ReferenceAttention,
    causal_mask,
    chunk_segment_ids,
    document_block_mask,
    document_causal_mask,
    fast_attention_route,
)
from llama_megatron.model.kv_cache import KVCache
from llama_megatron.parallel.context import ParallelContext
from llama_megatron.parallel.cross_entropy import vocab_parallel_cross_entropy
from llama_megatron.parallel.linear_cross_entropy import linear_cross_entropy_sum

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=2e-2, atol=1e-2)}
COMPILED = resolve_kernels("compiled", "cpu")


def test_kernel_choices_resolve() -> None:
    assert resolve_kernels("auto", "cpu") is REFERENCE
    assert resolve_kernels("auto", "cuda").name == "compiled"
    assert COMPILED.fused_loss and not REFERENCE.fused_loss
    assert set(COMPILED.describe()) == {"kernels", "norm_rope_swiglu", "attention", "loss"}
    with pytest.raises(ConfigError, match="needs a CUDA device"):
        resolve_kernels("liger", "cpu")
    with pytest.raises(ConfigError, match="not one of"):
        resolve_kernels("fast", "cpu")


def _leaves(*shapes, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=gen).to(dtype).requires_grad_() for s in shapes]


def _forward_backward(fn, inputs):
    outputs = fn(*inputs)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    gen = torch.Generator().manual_seed(99)
    grads = [torch.randn(o.shape, generator=gen).to(o.dtype) for o in outputs]
    torch.autograd.backward(outputs, grads)
    return [o.detach() for o in outputs], [t.grad for t in inputs if t.grad is not None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.launched
def test_compiled_elementwise_kernels_match_reference(dtype) -> None:
    """On the machine the tests run on (its vector ISA decides the generated code). Hidden 44 and head_dim 20 (RoPE
    halves of 10) leave a tail after 8-, 16- and 32-wide vectors as well as whole vectors: compiled CPU code handles
    tails separately, and compiled FlexAttention was wrong at such lengths on an AVX2-only CPU."""
    b, s, groups, g, d, h = 2, 5, 2, 3, 20, 44
    cos_sin = torch.randn(b, s, d).cos(), torch.randn(b, s, d).sin()
    cases = {
        "rms_norm": (lambda x, w: COMPILED.rms_norm(x, w, 1e-5), lambda x, w: ref_ops.rms_norm(x, w, 1e-5),
                     [(b, s, h), (h,)]),
        "add_rms_norm": (lambda r, x, w: COMPILED.add_rms_norm(r, x, w, 1e-5),
                         lambda r, x, w: ref_ops.add_rms_norm(r, x, w, 1e-5), [(b, s, h), (b, s, h), (h,)]),
        "rotary_qkv": (lambda qkv: COMPILED.rotary_qkv(qkv, *cos_sin), lambda qkv: ref_ops.rotary_qkv(qkv, *cos_sin),
                       [(b, s, groups, g + 2, d)]),
        "swiglu": (COMPILED.swiglu, ref_ops.swiglu, [(b, s, 2 * h)]),
    }
    for name, (fast, reference, shapes) in cases.items():
        got_out, got_grads = _forward_backward(fast, _leaves(*shapes, dtype=dtype))
        want_out, want_grads = _forward_backward(reference, _leaves(*shapes, dtype=dtype))
        for got, want in zip(got_out + got_grads, want_out + want_grads):
            assert got.dtype == want.dtype, name
            torch.testing.assert_close(got, want, **TOL[dtype], msg=lambda m, n=name: f"{n}: {m}")


def _packed_segments(batch: int, seq: int) -> torch.Tensor:
    lengths = [[3, 7, seq - 10], [seq]][:batch]
    return torch.stack([torch.cat([torch.full((n,), i) for i, n in enumerate(row)]) for row in lengths])


@pytest.mark.parametrize("groups", [1, 4])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("window", [None, 5])
def test_fast_attention_matches_reference(groups, packed, window) -> None:
    """SDPA enable_gqa (no K/V copies) and, for packed documents or a sliding window, the dense mask (the CPU route
    for training and inference alike) equal the reference attention, forward and backward and under no_grad.
    Sequence 24 is a length at which compiled FlexAttention was wrong on an AVX2-only CPU."""
    b, s, kv, d = 2, 24, 2, 8
    segments = _packed_segments(b, s) if packed else None
    shapes = [(b, s, kv * groups, d), (b, s, kv, d), (b, s, kv, d)]
    got_out, got_grads = _forward_backward(lambda q, k, v: FastAttention()(q, k, v, segments, window),
                                           _leaves(*shapes, dtype=torch.float32))
    want_out, want_grads = _forward_backward(lambda q, k, v: ReferenceAttention()(q, k, v, segments, window),
                                             _leaves(*shapes, dtype=torch.float32))
    for got, want in zip(got_out + got_grads, want_out + want_grads):
        torch.testing.assert_close(got, want, **TOL[torch.float32])
    with torch.no_grad():  # the inference path (evaluation, generate's prefill of packed prompts)
        q, k, v = (t.detach() for t in _leaves(*shapes, dtype=torch.float32))
        torch.testing.assert_close(FastAttention()(q, k, v, segments, window),
                                   ReferenceAttention()(q, k, v, segments, window), **TOL[torch.float32])


@pytest.mark.parametrize("window, chunk", [(None, None), (3, None), (None, 5)])
def test_cached_decoding_masks_match_the_full_sequence(window, chunk) -> None:
    """``after`` (the last positions of a sequence against every cached key, as generate calls it) equals the
    tail of attention over the whole sequence, with and without a sliding window or chunks, in both kernels."""
    b, s, kv, groups, d = 2, 12, 2, 2, 8
    q, k, v = (t.detach() for t in _leaves((b, s, kv * groups, d), (b, s, kv, d), (b, s, kv, d),
                                           dtype=torch.float32))
    segments = None if chunk is None else chunk_segment_ids(None, torch.arange(s).expand(b, s), chunk)
    whole = ReferenceAttention()(q, k, v, segments, window)
    for kernel in (ReferenceAttention(), FastAttention()):
        for tail in (1, 4):
            torch.testing.assert_close(kernel.after(q[:, -tail:], k, v, window, chunk), whole[:, -tail:],
                                       **TOL[torch.float32])


@pytest.mark.parametrize("calls", [[7, 1, 1, 1, 1, 1], [3, 2, 1, 1, 1, 1, 1, 1, 1], [12], [5, 1, 6]],
                         ids=["prompt-across-chunks", "prompt-in-chunk", "one-call", "later-call-across"])
def test_a_chunked_layer_cache_holds_one_chunk_and_decodes_as_the_whole_sequence(calls) -> None:
    """Decoding call by call through a chunked layer's cache (a prompt, then tokens one at a time; a call may cross
    chunk starts) gives each query what chunked attention over the whole sequence gives it, in both kernels, while
    the cache holds one chunk of keys, not the sequence's."""
    b, s, kv, groups, d, chunk = 2, 12, 2, 2, 8, 4
    q, k, v = (t.detach() for t in _leaves((b, s, kv * groups, d), (b, s, kv, d), (b, s, kv, d),
                                           dtype=torch.float32))
    whole = ReferenceAttention()(q, k, v, chunk_segment_ids(None, torch.arange(s).expand(b, s), chunk))
    for kernel in (ReferenceAttention(), FastAttention()):
        cache, whole_cache = (KVCache(1, b, s, kv, d, torch.float32, torch.device("cpu"), chunks)
                              for chunks in ([chunk], None))
        at = 0
        for n in calls:
            keys, values, first = cache.layers[0].append(k[:, at:at + n], v[:, at:at + n])
            assert first == at // chunk * chunk and keys.shape[1] == at + n - first
            torch.testing.assert_close(kernel.after(q[:, at:at + n], keys, values, None, chunk, first),
                                       whole[:, at:at + n], **TOL[torch.float32])
            whole_cache.layers[0].append(k[:, at:at + n], v[:, at:at + n])
            at += n
        assert cache.held_bytes() * s == whole_cache.held_bytes() * chunk


def test_chunks_and_windows_are_different_masks() -> None:
    """A chunk of 4 (Llama 4: a query sees its chunk's keys up to itself) is not a window of 4 (the 4 keys up to
    itself); packed documents count their chunks from their own starts."""
    s, size = 10, 4
    chunked = document_causal_mask(chunk_segment_ids(None, torch.arange(s).unsqueeze(0), size))[0, 0]
    i, j = torch.arange(s).unsqueeze(1), torch.arange(s).unsqueeze(0)
    assert torch.equal(chunked, (j <= i) & (j // size == i // size))
    assert torch.equal(causal_mask(s, s, size, torch.device("cpu")), (j <= i) & (j > i - size))
    assert not torch.equal(chunked, causal_mask(s, s, size, torch.device("cpu")))
    positions = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2, 3]])
    documents = torch.tensor([[0] * 6 + [1] * 4])
    assert chunk_segment_ids(documents, positions, size).tolist() == [[0, 0, 0, 0, 1, 1, 2, 2, 2, 2]]


def test_fast_attention_route() -> None:
    """FlexAttention only on CUDA; on CPU packed documents take the dense mask, with or without flash-attn
    installed, in every dtype; flash-attn only for CUDA half precision."""
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for have_flash in (False, True):
            assert fast_attention_route("cpu", dtype, packed=True, have_flash=have_flash) == "sdpa-dense-mask"
            assert fast_attention_route("cpu", dtype, packed=False, have_flash=have_flash) == "sdpa-causal"
    assert fast_attention_route("cuda", torch.float32, packed=True, have_flash=True) == "flex"
    assert fast_attention_route("cuda", torch.bfloat16, packed=True, have_flash=False) == "flex"
    assert fast_attention_route("cuda", torch.bfloat16, packed=False, have_flash=False) == "sdpa-causal"
    assert fast_attention_route("cuda", torch.bfloat16, packed=True, have_flash=True) == "flash"


_AVX2_ATTENTION = """
import torch
from llama_megatron.model.kernels.attention import _cpu_flash_packs_below_its_isa, _sdpa

gen = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(2, 128, 4, 16, generator=gen) for _ in range(3))
want = _sdpa(q, k, v, None, enable_gqa=False)
leaves = [t.bfloat16().requires_grad_() for t in (q, k, v)]
got = _sdpa(*leaves, None, enable_gqa=False)
got.float().sum().backward()
assert all(torch.isfinite(t.grad).all() for t in leaves)
# bf16 operands and output: a few units of bf16's last place (2^-8) of values of order 1
assert (got.float() - want).abs().max() < 2e-2, (got.float() - want).abs().max()
print("ok", _cpu_flash_packs_below_its_isa(), torch.cpu._is_amx_tile_supported())
"""


@pytest.mark.launched
def test_bf16_attention_runs_under_avx2_on_any_cpu() -> None:
    """Under ATEN_CPU_CAPABILITY=avx2 on an AMX Xeon, torch's CPU flash attention packs bf16 operands for AMX and
    its own packing refuses below AVX-512: our attention turns oneDNN off for the call there, and the kernel runs
    as on a CPU without AMX (forward and backward of 128 tokens, bf16, against fp32). Elsewhere nothing changes."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, ATEN_CPU_CAPABILITY="avx2", OMP_NUM_THREADS="1")
    env.pop("ONEDNN_MAX_CPU_ISA", None)
    result = subprocess.run([sys.executable, "-c", _AVX2_ATTENTION], env=env, capture_output=True, text=True,
                            check=False)
    assert result.returncode == 0 and result.stdout.startswith("ok"), result.stderr[-3000:]
    packs, amx = result.stdout.split()[1:]
    assert packs == amx  # on AMX oneDNN is off for the call, elsewhere never


@pytest.mark.parametrize("window", [None, 5])
def test_document_block_mask_matches_dense_mask(window) -> None:
    """The FlexAttention block mask CUDA runs is the reference's document (and window) mask: eager flex_attention
    (correct on every CPU, forward only) with it equals the reference attention, GQA included."""
    from torch.nn.attention.flex_attention import flex_attention

    b, s, kv, groups, d = 2, 24, 2, 4, 8
    segments = _packed_segments(b, s)
    q, k, v = (t.detach() for t in _leaves((b, s, kv * groups, d), (b, s, kv, d), (b, s, kv, d),
                                           dtype=torch.float32))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager flex_attention warns that it is the slow path
        got = flex_attention(*(t.transpose(1, 2) for t in (q, k, v)),
                             block_mask=document_block_mask(segments, window), enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(got, ReferenceAttention()(q, k, v, segments, window), **TOL[torch.float32])


def _reference_loss_sum(hidden, weight, target, pctx, vocab_size):
    logits = F.linear(hidden, weight)
    return vocab_parallel_cross_entropy(logits, target, pctx, vocab_size).sum()


def _loss_case(dtype, rows, vocab_size, seed=0, tokens=(3, 11)):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*tokens, 32, generator=gen).to(dtype).requires_grad_()
    weight = (0.3 * torch.randn(rows, 32, generator=gen)).to(dtype).requires_grad_()
    target = torch.randint(0, vocab_size, tokens, generator=gen)
    target[0, :4] = -100
    return hidden, weight, target


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_tokens", [4, None])
def test_chunked_linear_cross_entropy_matches_reference(dtype, chunk_tokens) -> None:
    """Loss sum and gradients of hidden states and weight; padded vocab rows masked; several chunks."""
    pctx = ParallelContext.single()
    results = []
    for fused in (True, False):
        hidden, weight, target = _loss_case(dtype, rows=40, vocab_size=37)
        scale = 1.0 / 29  # the caller's token mean: backward scales the gradients computed in forward
        if fused:
            loss = linear_cross_entropy_sum(hidden, weight, target, pctx, 37, chunk_tokens=chunk_tokens)
        else:
            loss = _reference_loss_sum(hidden, weight, target, pctx, 37)
        (loss * scale).backward()
        assert loss.dtype == torch.float32
        results.append((loss.detach(), hidden.grad, weight.grad))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, **TOL[dtype])
    assert not results[0][2][37:].any(), "padded vocab rows got gradient"


def test_chunked_loss_without_grad() -> None:
    """Evaluation: no gradient buffers are made, the loss is the same."""
    pctx = ParallelContext.single()
    hidden, weight, target = _loss_case(torch.float32, rows=40, vocab_size=37)
    with torch.no_grad():
        loss = linear_cross_entropy_sum(hidden, weight, target, pctx, 37, chunk_tokens=5)
        torch.testing.assert_close(loss, _reference_loss_sum(hidden, weight, target, pctx, 37))


def test_chunked_loss_results_outlive_its_scratch() -> None:
    """The logits scratch is kept across calls (CPU): a later, larger call must not change what an earlier one
    returned, and the earlier gradients stay those of a fresh process's reference."""
    pctx = ParallelContext.single()
    hidden, weight, target = _loss_case(torch.float32, rows=40, vocab_size=37)
    loss = linear_cross_entropy_sum(hidden, weight, target, pctx, 37, chunk_tokens=33)
    loss.backward()
    first = (loss.detach().clone(), hidden.grad.clone(), weight.grad.clone())
    big_hidden, big_weight, big_target = _loss_case(torch.float32, rows=40, vocab_size=37, seed=1, tokens=(7, 13))
    linear_cross_entropy_sum(big_hidden, big_weight, big_target, pctx, 37).backward()
    for kept, now in zip(first, (loss, hidden.grad, weight.grad)):
        assert torch.equal(kept, now)
    ref_hidden, ref_weight, _ = _loss_case(torch.float32, rows=40, vocab_size=37)
    _reference_loss_sum(ref_hidden, ref_weight, target, pctx, 37).backward()
    torch.testing.assert_close(weight.grad, ref_weight.grad, **TOL[torch.float32])


def test_chunked_loss_backward_runs_once() -> None:
    """Backward scales the stored gradients in place, so a second backward through a retained graph is refused
    instead of returning twice-scaled gradients."""
    hidden, weight, target = _loss_case(torch.float32, rows=40, vocab_size=37)
    loss = linear_cross_entropy_sum(hidden, weight, target, ParallelContext.single(), 37) / 29
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward can run once"):
        loss.backward()


def _tensor_parallel_loss_worker(rank: int, world_size: int) -> None:
    """Vocab 37 padded to 48 over TP2: rank 1 holds 13 real and 11 padded rows."""
    pctx = ParallelContext.build(tensor=world_size)
    hidden, weight, target = _loss_case(torch.float32, rows=48, vocab_size=37, seed=3)
    full_loss = _reference_loss_sum(hidden, weight, target, ParallelContext.single(), 37)
    full_loss.backward()
    rows = 48 // world_size
    local_hidden = hidden.detach().clone().requires_grad_()
    local_weight = weight.detach()[rank * rows:(rank + 1) * rows].clone().requires_grad_()
    loss = linear_cross_entropy_sum(local_hidden, local_weight, target, pctx, 37, chunk_tokens=4)
    loss.backward()
    torch.testing.assert_close(loss, full_loss.detach(), **TOL[torch.float32])
    # each rank's hidden gradient is its vocab shard's part (the TP copy's backward all-reduces it)
    torch.distributed.all_reduce(local_hidden.grad, group=pctx.tp_group)
    torch.testing.assert_close(local_hidden.grad, hidden.grad, **TOL[torch.float32])
    torch.testing.assert_close(local_weight.grad, weight.grad[rank * rows:(rank + 1) * rows], **TOL[torch.float32])


@pytest.mark.launched
def test_chunked_linear_cross_entropy_tensor_parallel() -> None:
    run_distributed(_tensor_parallel_loss_worker, 2)


@pytest.mark.parametrize("name", ["gqa-untied-bias", "mistral-window-5"])  # tied + odd vocabulary: the TP2 test
@pytest.mark.launched
def test_compiled_model_matches_hf_tp1(name) -> None:
    check_parity(CASES[name], ParallelContext.single(), kernels=COMPILED)


def _compiled_parity_worker(rank: int, world_size: int) -> None:
    for sp in (False, True):
        pctx = ParallelContext.build(tensor=world_size, sequence_parallel=sp)
        check_parity(CASES["gqa-tied-llama3-oddvocab"], pctx, kernels=resolve_kernels("compiled", "cpu"))


@pytest.mark.launched
def test_compiled_model_matches_hf_tp2_sp() -> None:
    run_distributed(_compiled_parity_worker, 2)
