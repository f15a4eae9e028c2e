"""Model features outside the HF parity suite: recomputation spans, flash-attn varlen boundaries."""

from __future__ import annotations

import torch
from model_utils import tiny_config

from llama_megatron.model.build import build_model
from llama_megatron.model.kernels.attention import cu_seqlens, document_causal_mask
from llama_megatron.model.layers import DecoderLayerPipe, EmbeddingPipe
from llama_megatron.parallel.context import ParallelContext
from llama_megatron.parallel.degrees import ParallelConfig


def test_activation_checkpointing_recomputes_decoder_spans_only() -> None:
    config = tiny_config(num_hidden_layers=4, num_key_value_heads=4)
    parallel = ParallelConfig(make_vocab_size_divisible_by=8)
    ids = torch.randint(0, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    results = {}
    for interval in (0, 1, 3):
        model = build_model(config, parallel, ParallelContext.single(), seed=5, activation_checkpoint_interval=interval)
        calls = {"decoder": 0, "embedding": 0}

        def count(kind: str, calls: dict = calls):
            # a pre-hook: recomputation may stop early, before a module's forward returns
            return lambda *_: calls.__setitem__(kind, calls[kind] + 1)

        for module in model.modules():
            if isinstance(module, DecoderLayerPipe):
                module.register_forward_pre_hook(count("decoder"))
            elif isinstance(module, EmbeddingPipe):
                module.register_forward_pre_hook(count("embedding"))
        loss = model(ids[:, :-1], labels=ids[:, 1:])
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        results[interval] = (loss.detach(), grads, dict(calls))
    base_loss, base_grads, base_calls = results[0]
    assert base_calls == {"decoder": 4, "embedding": 1}
    for interval in (1, 3):
        loss, grads, calls = results[interval]
        assert calls == {"decoder": 8, "embedding": 1}, "each decoder layer recomputed once, the embedding never"
        assert torch.equal(loss, base_loss)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, base_grads[name], rtol=1e-6, atol=1e-7)


def test_varlen_boundaries_match_the_block_diagonal_mask() -> None:
    segments = torch.tensor([[0, 0, 0, 1, 1, 2], [0, 1, 1, 1, 1, 1]])
    cu, max_len = cu_seqlens(segments)
    assert cu.tolist() == [0, 3, 5, 6, 7, 12] and cu.dtype == torch.int32
    assert max_len == 5
    mask = document_causal_mask(segments)[:, 0]
    # row 0, token 4 sees tokens 3..4 (its document), nothing before
    assert mask[0, 4].tolist() == [False, False, False, True, True, False]
    assert mask[1, 5].tolist() == [False, True, True, True, True, True]
