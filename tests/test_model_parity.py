"""The model is the same function as the transformers class of its family (LlamaForCausalLM, MistralForCausalLM,
Qwen2ForCausalLM, Qwen3ForCausalLM): logits, loss and every gradient, fp32.

Runs each configuration under TP in {1, 2, 4} (sequence parallelism on and off) in real gloo process groups. The
family cases: Qwen2's q/k/v biases with sliding windows on some layers (from max_window_layers, or layer_types),
Qwen3's q/k norms with head_dim != hidden / heads (with biases and tied embeddings too), Mistral's sliding window
on every layer; windows shorter than the sequence, hidden sizes other than LLaMA's 64 (96, 80).
Gradients of every TP shard are gathered and merged with the same code that exports checkpoints, then compared
with HF's gradients tensor by tensor.
"""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_distributed
from family_cases import DENSE_PARITY, FAMILIES
from model_utils import assert_grads_match_hf, hf_model, tiny_config

from llama_megatron.model.build import build_model
from llama_megatron.model.kernels import REFERENCE, Kernels
from llama_megatron.model.tp_slicing import hf_to_rank_state_dict
from llama_megatron.parallel.context import ParallelContext
from llama_megatron.parallel.degrees import ParallelConfig

LOGITS_ATOL = 1e-4
GRAD_TOL = dict(rtol=1e-4, atol=1e-6)

CASES = DENSE_PARITY  # every dense family's cases (tests/family_cases.py)


def test_every_family_has_test_cases() -> None:
    """A family of llama_megatron/families.py is tested once tests/family_cases.py has its row."""
    from llama_megatron.families import FAMILIES as MODEL_FAMILIES

    assert set(FAMILIES) == set(MODEL_FAMILIES)
    assert all(cases.parity for cases in FAMILIES.values())


def check_parity(overrides: dict, pctx: ParallelContext, seq: int = 16, kernels: Kernels = REFERENCE,
                 grad_tol: dict = GRAD_TOL) -> None:
    config = tiny_config(**overrides)
    parallel = ParallelConfig(tensor=pctx.tp_size, sequence_parallel=pctx.sequence_parallel,
                              make_vocab_size_divisible_by=8)
    padded = parallel.padded_vocab_size(config.vocab_size)
    hf = hf_model(config)
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, config.vocab_size, (2, seq), generator=gen)
    labels = ids.clone()
    labels[0, 3:6] = -100
    ref = hf(input_ids=ids, labels=labels)
    ref.loss.backward()

    model = build_model(config, parallel, pctx, initialize=False, kernels=kernels)
    model.load_state_dict(hf_to_rank_state_dict(hf.state_dict(), config, pctx.tp_rank, pctx.tp_size, padded))
    local_logits = model(ids)
    next_labels = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)  # HF's shift
    loss = model(ids, labels=next_labels)
    loss.backward()

    logits = model.full_logits(local_logits).detach()
    assert (logits - ref.logits).abs().max().item() <= LOGITS_ATOL
    torch.testing.assert_close(loss, ref.loss, rtol=1e-5, atol=1e-6)

    assert_grads_match_hf(model, hf, config, pctx, **grad_tol)


def _parity_worker(rank: int, world_size: int) -> None:
    for sp in (False, True):
        pctx = ParallelContext.build(tensor=world_size, sequence_parallel=sp)
        for overrides in CASES.values():
            check_parity(overrides, pctx)


@pytest.mark.parametrize("name", list(CASES))
def test_parity_tp1(name: str) -> None:
    check_parity(CASES[name], ParallelContext.single())


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.launched
def test_parity_tensor_parallel(tp: int) -> None:
    run_distributed(_parity_worker, tp)


def test_parity_dynamic_rope_beyond_max_positions() -> None:
    check_parity(dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}, max_position_embeddings=16),
                 ParallelContext.single(), seq=40)


@pytest.mark.parametrize("overrides", [dict(num_key_value_heads=4), CASES["mistral-window-5"],
                                       CASES["qwen2-layer-types"]], ids=["llama", "mistral", "qwen2"])
def test_per_document_attention_equals_separate_documents(overrides: dict) -> None:
    """A packed row [doc A | doc B] with segment ids and restarted positions = HF run on A and B alone (with a
    sliding window shorter than doc B: the window and the document boundary both apply)."""
    config = tiny_config(**overrides)
    hf = hf_model(config)
    model = build_model(config, ParallelConfig(make_vocab_size_divisible_by=8), ParallelContext.single(),
                        initialize=False)
    model.load_state_dict(hf_to_rank_state_dict(hf.state_dict(), config, 0, 1, 256))
    gen = torch.Generator().manual_seed(3)
    doc_a, doc_b = torch.randint(0, 256, (1, 5), generator=gen), torch.randint(0, 256, (1, 11), generator=gen)
    packed = torch.cat([doc_a, doc_b], dim=1)
    positions = torch.cat([torch.arange(5), torch.arange(11)]).unsqueeze(0)
    segments = torch.cat([torch.zeros(5), torch.ones(11)]).long().unsqueeze(0)
    with torch.no_grad():
        logits = model.full_logits(model(packed, positions, segments))
        ref = torch.cat([hf(input_ids=doc_a).logits, hf(input_ids=doc_b).logits], dim=1)
    assert (logits - ref).abs().max().item() <= LOGITS_ATOL
