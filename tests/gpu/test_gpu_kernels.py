"""Fast kernels on CUDA against the reference kernels (runs where CUDA is present, skips elsewhere).

Tolerances: a single operation in bf16 is held to the error of the reference itself: each output and gradient of
the fast kernel is compared with the reference computed in fp32 on the same (bf16) inputs, and its largest error
may be at most twice the bf16 reference's own, plus 1e-3 (a fused kernel rounds once, where the reference rounds
every intermediate: a fixed tolerance fails on one bf16 step of a value of 8, 0.03, landing on an element near 0;
seen on an H200, 2026-11-27). fp32: 1e-4 relative, 1e-5 absolute (TF32 is off: torch's default for matmuls).
Whole models in bf16: loss within 1e-2 relative, logits 5e-2 absolute.
"""

from __future__ import annotations

import pytest
import torch
from model_utils import hf_model, tiny_config

from llama_megatron.model.build import build_model
from llama_megatron.model.kernels import REFERENCE, resolve_kernels
from llama_megatron.model.kernels.attention import FastAttention, ReferenceAttention
from llama_megatron.model.tp_slicing import hf_to_rank_state_dict
from llama_megatron.parallel.context import ParallelContext
from llama_megatron.parallel.cross_entropy import vocab_parallel_cross_entropy
from llama_megatron.parallel.degrees import ParallelConfig
from llama_megatron.parallel.linear_cross_entropy import linear_cross_entropy_sum

# launched: torch.compile's first compilation starts worker processes (the compiled kernels)
pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"), pytest.mark.launched]

TOL = {torch.bfloat16: dict(rtol=2e-2, atol=2e-2), torch.float32: dict(rtol=1e-4, atol=1e-5)}
FAST = ["compiled", "liger"]


def _kernels(name):
    if name == "liger":
        pytest.importorskip("liger_kernel", reason="liger-kernel is the GPU extra (pip install -e '.[gpu]')")
    return resolve_kernels(name, "cuda")


def _leaves(*shapes, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(*s, generator=gen, device="cuda").to(dtype).requires_grad_() for s in shapes]


def _rope_tables(b: int, s: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin as RoPE makes them ([b, s, d], both halves equal: Liger's kernel reads the first half only),
    at random positions."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    positions = torch.randint(0, 4096, (b, s), generator=gen, device="cuda").float()
    inv_freq = 10000.0 ** -(torch.arange(0, d, 2, device="cuda").float() / d)
    angles = positions[..., None] * inv_freq
    return torch.cat([angles, angles], dim=-1).cos(), torch.cat([angles, angles], dim=-1).sin()


def assert_like_reference(fast_fn, reference_fn, shapes, dtype, what: str) -> None:
    """Outputs and input gradients of ``fast_fn`` against ``reference_fn`` (see the module's tolerances)."""
    got = _run(fast_fn, _leaves(*shapes, dtype=dtype))
    want = _run(reference_fn, _leaves(*shapes, dtype=dtype))
    if dtype == torch.float32:
        for a, w in zip(got, want):
            torch.testing.assert_close(a, w, **TOL[dtype], msg=lambda m: f"{what}: {m}")
        return
    truth = _run(reference_fn, [t.detach().float().requires_grad_() for t in _leaves(*shapes, dtype=dtype)])
    for i, (a, w, t) in enumerate(zip(got, want, truth)):
        fast_err = (a.float() - t).abs().max().item()
        reference_err = (w.float() - t).abs().max().item()
        assert fast_err <= 2 * reference_err + 1e-3, (what, i, fast_err, reference_err)


def _run(fn, inputs):
    outs = fn(*inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    gen = torch.Generator(device="cuda").manual_seed(9)
    torch.autograd.backward(outs, [torch.randn(o.shape, generator=gen, device="cuda").to(o.dtype) for o in outs])
    return [o.detach() for o in outs] + [t.grad for t in inputs]


@pytest.mark.parametrize("name", FAST)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_elementwise_kernels_match_reference(name, dtype) -> None:
    fast = _kernels(name)
    b, s, groups, g, d, h = 2, 64, 4, 4, 64, 256
    cos, sin = _rope_tables(b, s, d)
    cases = {
        "rms_norm": (lambda k: (lambda x, w: k.rms_norm(x, w, 1e-5)), [(b, s, h), (h,)]),
        "add_rms_norm": (lambda k: (lambda r, x, w: k.add_rms_norm(r, x, w, 1e-5)), [(b, s, h), (b, s, h), (h,)]),
        "rotary_qkv": (lambda k: (lambda qkv: k.rotary_qkv(qkv, cos, sin)), [(b, s, groups, g + 2, d)]),
        "swiglu": (lambda k: k.swiglu, [(b, s, 2 * h)]),
    }
    for op, (make, shapes) in cases.items():
        assert_like_reference(make(fast), make(REFERENCE), shapes, dtype, f"{name} {op}")


@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fast_attention_matches_reference(packed, dtype, window) -> None:
    """flash-attn / SDPA enable_gqa, and varlen / FlexAttention for packed documents, forward and backward; with a
    sliding window (Mistral, Qwen): flash-attn's window_size, FlexAttention's block mask."""
    b, s, kv, g, d = 2, 256, 2, 4, 64
    segments = (torch.arange(s, device="cuda") // 40).expand(b, s).contiguous() if packed else None
    shapes = [(b, s, kv * g, d), (b, s, kv, d), (b, s, kv, d)]
    got = _run(lambda q, k, v: FastAttention()(q, k, v, segments, window), _leaves(*shapes, dtype=dtype))
    want = _run(lambda q, k, v: ReferenceAttention()(q, k, v, segments, window), _leaves(*shapes, dtype=dtype))
    for a, w in zip(got, want):
        torch.testing.assert_close(a, w, **TOL[dtype])


def test_chunked_loss_matches_reference_bf16() -> None:
    pctx = ParallelContext.single()
    results = []
    for fused in (True, False):
        gen = torch.Generator(device="cuda").manual_seed(0)
        hidden = torch.randn(4, 512, 256, generator=gen, device="cuda").bfloat16().requires_grad_()
        weight = (0.05 * torch.randn(1000, 256, generator=gen, device="cuda")).bfloat16().requires_grad_()
        target = torch.randint(0, 990, (4, 512), generator=gen, device="cuda")
        target[:, :7] = -100
        if fused:
            total = linear_cross_entropy_sum(hidden, weight, target, pctx, 990, chunk_tokens=300)
        else:
            total = vocab_parallel_cross_entropy(hidden @ weight.t(), target, pctx, 990).sum()
        (total / 2000).backward()
        results.append((total.detach(), hidden.grad.float(), weight.grad.float()))
    for a, w in zip(*results):
        torch.testing.assert_close(a, w, **TOL[torch.bfloat16])


@pytest.mark.parametrize("name", FAST)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_whole_model_matches_reference(name, dtype) -> None:
    """Loss and logits of the model with fast kernels vs the reference kernels and HF, same weights."""
    fast = _kernels(name)
    config = tiny_config(num_key_value_heads=2, hidden_size=256, num_attention_heads=8, intermediate_size=512)
    hf = hf_model(config).cuda().to(dtype)
    state = hf_to_rank_state_dict(hf.state_dict(), config, 0, 1, 256)
    ids = torch.randint(0, config.vocab_size, (2, 64), device="cuda")
    losses, logits = {}, {}
    for label, kernels in (("reference", REFERENCE), (name, fast)):
        model = build_model(config, ParallelConfig(make_vocab_size_divisible_by=8), ParallelContext.single(),
                            initialize=False, kernels=kernels).cuda().to(dtype)
        model.load_state_dict(state)
        losses[label] = model(ids[:, :-1], labels=ids[:, 1:])
        losses[label].backward()
        with torch.no_grad():
            logits[label] = model(ids).float()
    hf_loss = hf(input_ids=ids, labels=ids).loss.float()
    for label in losses:
        torch.testing.assert_close(losses[label].float(), hf_loss, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(logits[name], logits["reference"], rtol=0, atol=5e-2 if dtype != torch.float32
                               else 1e-4)
