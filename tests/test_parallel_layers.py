"""Each tensor-parallel layer against its dense twin, forward and backward, in real gloo process groups."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from dist_utils import run_distributed

from llama_megatron.parallel.collectives import scatter_to_tp_region
from llama_megatron.parallel.context import ParallelContext
from llama_megatron.parallel.cross_entropy import vocab_parallel_cross_entropy, vocab_parallel_entropy
from llama_megatron.parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

B, S, IN, OUT = 2, 8, 12, 16
TOL = dict(rtol=1e-5, atol=1e-6)


def _chunk(t: torch.Tensor, dim: int, pctx: ParallelContext) -> torch.Tensor:
    return t.chunk(pctx.tp_size, dim=dim)[pctx.tp_rank]


def _dense_linear(x, w, b, g):
    x = x.clone().requires_grad_()
    w = w.clone().requires_grad_()
    b = b.clone().requires_grad_()
    y = F.linear(x, w, b)
    (y * g).sum().backward()
    return y.detach(), x.grad, w.grad, b.grad


def _check_column(pctx: ParallelContext) -> None:
    gen = torch.Generator().manual_seed(1)
    x, w, b = torch.randn(B, S, IN, generator=gen), torch.randn(OUT, IN, generator=gen), torch.randn(OUT, generator=gen)
    g = torch.randn(B, S, OUT, generator=gen)
    y_ref, x_grad, w_grad, b_grad = _dense_linear(x, w, b, g)
    layer = ColumnParallelLinear(IN, OUT, pctx, "column", bias=True)
    with torch.no_grad():
        layer.weight.copy_(_chunk(w, 0, pctx))
        layer.bias.copy_(_chunk(b, 0, pctx))
    x_in = (_chunk(x, 1, pctx) if pctx.sequence_parallel else x).clone().requires_grad_()
    y = layer(x_in)
    torch.testing.assert_close(y, _chunk(y_ref, -1, pctx), **TOL)
    (y * _chunk(g, -1, pctx)).sum().backward()
    torch.testing.assert_close(x_in.grad, _chunk(x_grad, 1, pctx) if pctx.sequence_parallel else x_grad, **TOL)
    torch.testing.assert_close(layer.weight.grad, _chunk(w_grad, 0, pctx), **TOL)
    torch.testing.assert_close(layer.bias.grad, _chunk(b_grad, 0, pctx), **TOL)
    assert layer.weight.tensor_model_parallel and layer.weight.partition_dim == 0

    gathered = ColumnParallelLinear(IN, OUT, pctx, "column", bias=True, gather_output=True)
    gathered.load_state_dict(layer.state_dict())
    if not pctx.sequence_parallel:
        torch.testing.assert_close(gathered(x), y_ref, **TOL)


def _check_row(pctx: ParallelContext) -> None:
    gen = torch.Generator().manual_seed(2)
    x, w, b = torch.randn(B, S, OUT, generator=gen), torch.randn(IN, OUT, generator=gen), torch.randn(IN, generator=gen)
    g = torch.randn(B, S, IN, generator=gen)
    y_ref, x_grad, w_grad, b_grad = _dense_linear(x, w, b, g)
    layer = RowParallelLinear(OUT, IN, pctx, bias=True)
    with torch.no_grad():
        layer.weight.copy_(_chunk(w, 1, pctx))
        layer.bias.copy_(b)
    x_in = _chunk(x, -1, pctx).clone().requires_grad_()
    y = layer(x_in)
    if pctx.sequence_parallel:
        torch.testing.assert_close(y, _chunk(y_ref, 1, pctx), **TOL)
        (y * _chunk(g, 1, pctx)).sum().backward()
    else:
        torch.testing.assert_close(y, y_ref, **TOL)
        (y * g).sum().backward()
    torch.testing.assert_close(x_in.grad, _chunk(x_grad, -1, pctx), **TOL)
    torch.testing.assert_close(layer.weight.grad, _chunk(w_grad, 1, pctx), **TOL)
    torch.testing.assert_close(layer.bias.grad, b_grad, **TOL)
    assert layer.weight.partition_dim == 1
    # the output (a pipeline stage's payload after the residual add) must be sendable: contiguous, batch > 1
    assert y.is_contiguous() and x_in.grad.is_contiguous()


def _check_embedding(pctx: ParallelContext) -> None:
    vocab, padded, hidden = 50, 64, 8
    gen = torch.Generator().manual_seed(3)
    table = torch.randn(vocab, hidden, generator=gen)
    ids = torch.randint(0, vocab, (B, S), generator=gen)
    g = torch.randn(B, S, hidden, generator=gen)
    dense_table = table.clone().requires_grad_()
    ref = F.embedding(ids, dense_table)
    (ref * g).sum().backward()
    padded_table = torch.cat([table, torch.zeros(padded - vocab, hidden)])
    padded_grad = torch.cat([dense_table.grad, torch.zeros(padded - vocab, hidden)])

    layer = VocabParallelEmbedding(padded, hidden, pctx)
    with torch.no_grad():
        layer.weight.copy_(_chunk(padded_table, 0, pctx))
    out = layer(ids)
    if pctx.sequence_parallel:
        torch.testing.assert_close(out, _chunk(ref.detach(), 1, pctx), **TOL)
        (out * _chunk(g, 1, pctx)).sum().backward()
    else:
        torch.testing.assert_close(out, ref.detach(), **TOL)
        (out * g).sum().backward()
    torch.testing.assert_close(layer.weight.grad, _chunk(padded_grad, 0, pctx), **TOL)


def _check_cross_entropy(pctx: ParallelContext) -> None:
    vocab, padded, tokens = 37, 48, 20
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(2, tokens // 2, padded, generator=gen) * 3
    logits[..., vocab:] = 50.0  # huge padded logits must still be ignored
    target = torch.randint(0, vocab, (2, tokens // 2), generator=gen)
    target[0, :3] = -100
    weights = torch.rand(2, tokens // 2, generator=gen)

    dense = logits[..., :vocab].clone().requires_grad_()
    ref = F.cross_entropy(dense.flatten(0, 1), target.flatten(), ignore_index=-100, reduction="none").view_as(target)
    (ref * weights).sum().backward()
    ref_grad = torch.cat([dense.grad, torch.zeros(2, tokens // 2, padded - vocab)], dim=-1)

    local = _chunk(logits, -1, pctx).clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, target, pctx, vocab_size=vocab)
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-5)
    (loss * weights).sum().backward()
    torch.testing.assert_close(local.grad, _chunk(ref_grad, -1, pctx), rtol=1e-5, atol=1e-6)

    bf16 = vocab_parallel_cross_entropy(local.detach().bfloat16(), target, pctx, vocab_size=vocab)
    assert bf16.dtype == torch.float32
    # each position's entropy over the true vocabulary (the huge padded logits left out), against torch's
    # Categorical on the whole true logits; fp32 sums of 37 terms in another order: 1e-5
    entropy = vocab_parallel_entropy(local, pctx, vocab)
    want = torch.distributions.Categorical(logits=logits[..., :vocab]).entropy()
    torch.testing.assert_close(entropy, want, rtol=1e-5, atol=1e-5)
    assert not entropy.requires_grad


def _check_scatter_gather(pctx: ParallelContext) -> None:
    x = torch.arange(2 * 3 * 8, dtype=torch.float32).view(2, 3, 8).requires_grad_()
    part = scatter_to_tp_region(x, pctx)
    torch.testing.assert_close(part, _chunk(x.detach(), -1, pctx))
    part.sum().backward()
    torch.testing.assert_close(x.grad, torch.ones_like(x))


def _layers_worker(rank: int, world_size: int) -> None:
    for sp in (False, True):
        pctx = ParallelContext.build(tensor=world_size, sequence_parallel=sp)
        _check_column(pctx)
        _check_row(pctx)
        _check_embedding(pctx)
        if not sp:
            _check_cross_entropy(pctx)
            _check_scatter_gather(pctx)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.launched
def test_parallel_layers_match_dense(tp: int) -> None:
    run_distributed(_layers_worker, tp)


def test_single_process_layers_without_torch_distributed() -> None:
    pctx = ParallelContext.single()
    _check_column(pctx)
    _check_row(pctx)
    _check_embedding(pctx)
    _check_cross_entropy(pctx)
