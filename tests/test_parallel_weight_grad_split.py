"""The weight-gradient split of the tensor-parallel linears (parallel/weight_grad.py), the ground zero-bubble
pipeline schedules stand on: with a store attached, a backward computes every gradient bit for bit as the plain
model does; inside ``input_gradients_only`` it computes the input gradients only, and the queued W groups, run
later in order, complete the parameter gradients bit for bit, also summed over several micro batches whose B and W
interleave as a pipeline schedule runs them (B1 B2 W1 B3 W2 W3). TP1 (with recomputation and biases) in one process,
TP2 with and without sequence parallelism in two gloo processes (the norms' weight gradients accumulated in W, under
SP with their TP all-reduce); LoRA adapters on a frozen base (their weights
through the TP all-reduce of replicated adapters, with and without adapter dropout) at TP1 and TP2.
"""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_distributed
from model_utils import tiny_config

from llama_megatron.model.build import build_model
from llama_megatron.model.lora_layout import LORA_TARGETS, LoraConfig, is_adapter_parameter
from llama_megatron.model.norm import RMSNorm
from llama_megatron.parallel.context import ParallelContext
from llama_megatron.parallel.degrees import ParallelConfig
from llama_megatron.parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from llama_megatron.parallel.weight_grad import WeightGradStore, attach_weight_grad_store

MICRO_BATCHES = 3


def _model(pctx: ParallelContext, recompute: int = 0, lora: LoraConfig | None = None, **overrides):
    config = tiny_config(**overrides)
    parallel = ParallelConfig(tensor=pctx.tp_size, sequence_parallel=pctx.sequence_parallel,
                              make_vocab_size_divisible_by=8)
    model = build_model(config, parallel, pctx, seed=7, activation_checkpoint_interval=recompute, lora=lora)
    generator = torch.Generator().manual_seed(11)
    with torch.no_grad():  # adapters B start at zero, which would leave A's gradients zero
        for name, param in model.named_parameters():
            if is_adapter_parameter(name):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    return model, config


def _batches(config, pctx: ParallelContext) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(3)
    out = []
    for _ in range(MICRO_BATCHES):
        ids = torch.randint(0, config.vocab_size, (2, 16), generator=generator)
        out.append((ids, ids.roll(-1, dims=1)))
    return out


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _check(pctx: ParallelContext, recompute: int = 0, lora: LoraConfig | None = None, **overrides) -> None:
    model, config = _model(pctx, recompute, lora, **overrides)
    batches = _batches(config, pctx)
    torch.manual_seed(5)  # adapter dropout draws the same masks in each of the three passes
    for ids, labels in batches:  # the plain model: every gradient at once
        model(ids, labels=labels).backward()
    want = _grads(model)
    model.zero_grad(set_to_none=True)

    store = WeightGradStore()
    linears = [m for m in model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
    adapters = [m for m in model.modules() if type(m).__name__ in ("ColumnLoRA", "RowLoRA")]
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    assert len(linears) == 4 * config.num_hidden_layers + 1 and len(norms) == 2 * config.num_hidden_layers + 1
    # and the embedding, for the tied head's product
    assert attach_weight_grad_store(model, store) == len(linears) + len(adapters) + len(norms) + 1
    assert len(adapters) == (4 * config.num_hidden_layers if lora else 0)
    torch.manual_seed(5)
    for ids, labels in batches:  # attached but not deferring: the same gradients, bit for bit
        model(ids, labels=labels).backward()
    assert _grads(model).keys() == want.keys()
    for name, grad in _grads(model).items():
        assert torch.equal(grad, want[name]), name
    model.zero_grad(set_to_none=True)

    deferred = {f"{module_name}.{name}" for module_name, m in model.named_modules()
                if hasattr(m, "weight_grad_store") and not isinstance(m, VocabParallelEmbedding)  # its lookup: in B
                for name, _ in m.named_parameters(recurse=False) if name != "bias"}
    order = ["B0", "B1", "W", "B2", "W", "W"]  # a pipeline's interleaving: W runs oldest first
    torch.manual_seed(5)
    losses = iter([model(ids, labels=labels) for ids, labels in batches])
    for step in order:
        if step == "W":
            store.run_oldest()
            continue
        with store.input_gradients_only():
            next(losses).backward()
        if step == "B0":  # B alone leaves the linears' (and adapters') weights without gradient, the rest with theirs
            grads = _grads(model)
            assert deferred & set(want) and not deferred & set(grads)
            assert any(n.endswith("word_embeddings.weight") for n in grads) or (lora and not grads)
    assert store.pending == 0
    got = _grads(model)
    assert got.keys() == want.keys()
    for name, grad in got.items():
        assert torch.equal(grad, want[name]), name


@pytest.mark.parametrize("recompute, bias", [(0, False), (1, True)])
def test_split_backward_is_bit_exact_in_one_process(recompute, bias) -> None:
    _check(ParallelContext.single(), recompute, attention_bias=bias, mlp_bias=bias)


@pytest.mark.parametrize("dropout", [0.0, 0.1])  # one matmul for the stacked A's, or one per target
def test_split_backward_of_lora_adapters_is_bit_exact(dropout) -> None:
    _check(ParallelContext.single(), lora=LoraConfig(rank=4, alpha=8.0, targets=LORA_TARGETS, dropout=dropout))


def _worker(rank: int, world_size: int) -> None:
    for sp in (False, True):
        _check(ParallelContext.build(tensor=world_size, sequence_parallel=sp))
    lora = LoraConfig(rank=4, alpha=8.0, targets=LORA_TARGETS, dropout=0.1)
    _check(ParallelContext.build(tensor=world_size, sequence_parallel=True), lora=lora)


@pytest.mark.launched
def test_split_backward_is_bit_exact_at_tp2() -> None:
    run_distributed(_worker, 2)
