"""The profile's call graph module by module (training/diagnostics/call_graph.py): every module's forward and
backward FLOPs against the hand formulas, for every MoE family (the shared expert and its gate among them), and under
TP2 with SP each pipeline layer's collective bytes against collective_traffic's formula.

Hand formulas, per micro batch of b rows of s tokens (n = b x s): a linear whose weight holds w elements and that
multiplies r rows is one GEMM forward, 2 r w FLOPs (the router, the shared expert's gate, the attention's and MLP's
linears, the head: r = n, every TP rank multiplying the whole, gathered sequence; an expert: r = the tokens routed
to it, read from the model's own routing), and two backward (the input's gradient and the weight's), 4 r w.
Attention on SDPA's math path (torch.utils.flop_counter has no formula for the CPU's fused kernel) is its two
batched products, q k^T and the weights times v, 2 x 2 b H s^2 d forward (H the rank's heads; the dense mask
computes every key) and twice that backward. Nothing else has a FLOP formula (norms, RoPE, softmax, the loss).

TP1 in this process; TP2 with SP on two gloo ranks (tests/dist_utils.py), each rank checking its own figures, routing
counts from the model's own routing.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from dist_utils import run_distributed
from family_cases import FAMILIES, MOE_PARITY, RUNS
from launch_utils import PRETRAIN_CONFIG
from model_utils import tiny_config
from torch.nn.attention import SDPBackend, sdpa_kernel

from llama_megatron.model.attention import ParallelAttention
from llama_megatron.model.build import build_model
from llama_megatron.model.latent_attention import LatentAttention, ReplicatedLinear
from llama_megatron.model.moe import MoEMLP, Router
from llama_megatron.parallel.context import ParallelContext
from llama_megatron.parallel.degrees import ParallelConfig
from llama_megatron.parallel.layers import (
    ColumnParallelLinear,
    LocalLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from llama_megatron.parallel.weight_grad import WeightGradStore, attach_weight_grad_store
from llama_megatron.training.config import TrainingConfig
from llama_megatron.training.diagnostics.call_graph import OUTSIDE, CallGraphRecorder, group_names
from llama_megatron.training.diagnostics.collective_traffic import (
    decoder_layer_transfers,
    end_layer_transfers,
    rank_step_bytes,
)

LINEARS = (ColumnParallelLinear, RowParallelLinear, LocalLinear, Router, ReplicatedLinear)
B, S = 2, 16
QWEN2_MOE = next(iter(FAMILIES["qwen2_moe"].parity.values()))  # a shared expert and its gate
# every MoE family's parity cases, and a dense llama with q/k/v/o and MLP biases (addmm, as the biases' linears run)
CASES = {**MOE_PARITY, "llama-bias": dict(num_key_value_heads=4, attention_bias=True, mlp_bias=True)}


@contextlib.contextmanager
def routed_tokens(model: torch.nn.Module):
    """{MoE block's name: tokens routed to each expert}, from each block's output statistics (the assignment
    counts its own routing made) in the forward passes run inside."""
    counts: dict[str, list[int]] = {}
    names = {module: name for name, module in model.named_modules()}

    def read(module, args, output) -> None:
        counts[names[module]] = [int(c) for c in output[1][0].tolist()]

    handles = [m.register_forward_hook(read) for m in model.modules() if isinstance(m, MoEMLP)]
    try:
        yield counts
    finally:
        for handle in handles:
            handle.remove()


def hand_forward_flops(model: torch.nn.Module, root: str, routed: dict[str, list[int]], b: int, s: int,
                       top_k: int, tied: bool) -> dict[str, int]:
    """The forward FLOPs of each module with a GEMM, by the module docstring's formulas."""
    for counts in routed.values():  # each token went to its k experts: the counts are a whole routing
        assert sum(counts) == b * s * top_k, counts
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, ParallelAttention):
            heads = module.config.num_attention_heads // module.pctx.tp_size  # this TP rank's
            flops = 2 * 2 * b * heads * s * s * module.config.head_dim
        elif isinstance(module, LatentAttention):  # QK^T over q/k heads of nope + rope, AV over v heads
            config = module.config
            flops = 2 * b * module.heads * s * s * (config.qk_head_dim + config.v_head_dim)
        elif isinstance(module, LINEARS):
            block, _, expert = name.partition(".experts.")
            rows = routed[block][int(expert.split(".")[0])] if expert else b * s
            flops = 2 * rows * module.weight.numel()
        elif isinstance(module, VocabParallelEmbedding) and tied:  # the tied head's product
            flops = 2 * b * s * module.weight.numel()
        else:
            continue
        if flops:
            out[f"{root}.{name}"] = flops
    return out


def counted(recorder: CallGraphRecorder, which: str) -> dict[str, int]:
    """Module -> its ``forward_flops`` or ``backward_flops`` in the call graph's summary (those with any)."""
    modules = recorder.summary()["modules"]
    return {name: entry[which] for name, entry in modules.items() if entry[which]}


def _step(config, b: int = B, s: int = S, store: WeightGradStore | None = None, **build):
    """One micro batch, forward and backward, under the recorder (and a W pass after B with ``store``): the
    recorder, the model and its routing."""
    model = build_model(config, ParallelConfig(make_vocab_size_divisible_by=1), ParallelContext.single(), **build)
    if store is not None:
        attach_weight_grad_store(model, store)
    ids = torch.randint(0, config.vocab_size, (b, s + 1), generator=torch.Generator().manual_seed(0))
    recorder = CallGraphRecorder()
    with sdpa_kernel(SDPBackend.MATH), recorder:
        with routed_tokens(model) as routed:
            loss = model(ids[:, :-1], labels=ids[:, 1:])
        with store.input_gradients_only() if store is not None else contextlib.nullcontext():
            loss.backward()
        if store is not None:
            store.run_oldest()
        after = recorder.modules.current()
    assert after == (OUTSIDE, False)  # what runs after the step is no module's (no module left "running")
    return recorder, model, routed


@pytest.mark.parametrize("case", list(CASES))
def test_each_modules_forward_and_backward_flops_are_the_hand_formulas(case) -> None:
    """TP1: every module's forward FLOPs are its GEMMs' (the experts' from the tokens routed to each) and its
    backward FLOPs twice them, exactly; no other module counts any (the backward of the router, the routed experts
    and the shared expert's gate are theirs, not the shared expert's, which runs after them on the same input)."""
    config = tiny_config(**CASES[case])
    recorder, model, routed = _step(config)
    want = hand_forward_flops(model, type(model).__name__, routed, B, S, config.num_experts_per_tok,
                              config.tie_word_embeddings)
    assert counted(recorder, "forward_flops") == want
    assert counted(recorder, "backward_flops") == {name: 2 * flops for name, flops in want.items()}


def test_recomputed_layers_count_their_forward_again_in_the_backward() -> None:
    """Activation checkpointing (every decoder layer its own span, torch's non-reentrant checkpoint): the backward
    recomputes each layer's forward, whose GEMMs go to the module running them, so a decoder layer's modules count
    3x their forward FLOPs in the backward and the embedding and head 2x. The recomputation stops early (torch's
    default) by raising inside the MoE block after its last GEMM: the modules it leaves unfinished are no longer
    running when the backward goes on (the step's last check in ``_step``)."""
    config = tiny_config(**QWEN2_MOE)
    recorder, model, routed = _step(config, activation_checkpoint_interval=1)
    root = type(model).__name__
    want = hand_forward_flops(model, root, routed, B, S, config.num_experts_per_tok, False)
    layers = {f"{root}.{i}." for i in range(1, config.num_hidden_layers + 1)}
    assert counted(recorder, "forward_flops") == want
    assert counted(recorder, "backward_flops") == {
        name: (3 if any(name.startswith(layer) for layer in layers) else 2) * flops for name, flops in want.items()}


def test_a_w_pass_credits_each_weight_gradient_to_its_linear() -> None:
    """A zero-bubble split (parallel/weight_grad.py): B computes the input gradients, then W the queued weight
    gradients outside autograd's backward. Each module's backward FLOPs are still twice its forward, and each
    linear's W product (``weight_grad.py``'s deferred ``compute``) is its own, its forward's FLOPs."""
    config = tiny_config(**QWEN2_MOE)
    recorder, model, routed = _step(config, store=WeightGradStore())
    want = hand_forward_flops(model, type(model).__name__, routed, B, S, config.num_experts_per_tok, False)
    assert counted(recorder, "forward_flops") == want
    assert counted(recorder, "backward_flops") == {name: 2 * flops for name, flops in want.items()}
    deferred: dict[str, int] = {}
    for row in recorder.rows.values():
        if row.frame.startswith("llama_megatron/parallel/weight_grad.py") and row.frame.endswith(" compute"):
            assert row.backward, row
            deferred[row.module] = deferred.get(row.module, 0) + row.flops
    linears = {f"{type(model).__name__}.{name}" for name, m in model.named_modules() if isinstance(m, LINEARS)}
    assert deferred == {name: flops for name, flops in want.items() if name in linears}


def test_float8_linears_are_credited_their_gemms() -> None:
    """FP8 (parallel/float8.py, its own autograd Function and torchao's float8 tensors): every selected linear's
    three GEMMs are its own, counted at their logical shapes (the mm the Function issues on float8 tensors, whose
    weight-gradient padding of the tokens to 16 happens below it), so the figures are the high-precision ones."""
    pytest.importorskip("torchao.float8")
    from llama_megatron.parallel.float8 import Float8Config

    config = tiny_config(**MOE_PARITY["top2-of-4-window"])
    recorder, model, routed = _step(config, fp8=Float8Config(recipe="rowwise"))
    want = hand_forward_flops(model, type(model).__name__, routed, B, S, config.num_experts_per_tok, False)
    assert counted(recorder, "forward_flops") == want
    assert counted(recorder, "backward_flops") == {name: 2 * flops for name, flops in want.items()}


def _layer_index(module: str) -> int | None:
    """The pipeline layer a module belongs to (``LlamaCausalLM.3.mlp``: 3), None outside the layers."""
    parts = module.split(".")
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else None


# the launched runs' families (tests/family_cases.py), and llama with the row-parallel biases SP all-reduces
TP2_SP = {**{family: RUNS[family] for family in ("mixtral", "qwen3_moe", "qwen2_moe", "llama4")},
          "llama-bias": ["model.attention_bias=true", "model.mlp_bias=true"]}


@pytest.mark.launched
@pytest.mark.parametrize("family", list(TP2_SP))
def test_tp2_with_sp_modules_and_collectives_are_the_formulas(family) -> None:
    """TP2 with SP, one micro batch of one row, on two gloo ranks, each checking its own: every module's forward and
    backward FLOPs are the hand formulas on the rank's shards (the router and the shared expert's gate whole on each
    TP rank: they are replicated), and each pipeline layer's TP collective bytes are collective_traffic's formula
    exactly: the decoder layers' (the norms', the row-parallel biases', the router's and the gate's
    weight-gradient all-reduces among them), the embedding's, the final norm's weight-gradient all-reduce and the
    head's; the rank's all-gathers and reduce-scatters are its formula's. What is left, the loss's all-reduces, is
    issued outside every layer."""
    run_distributed(_tp2_sp_rank, 2, family)


def _tp2_sp_rank(rank: int, world_size: int, family: str) -> None:
    config = TrainingConfig.from_file(PRETRAIN_CONFIG, [
        'data={"type": "synthetic"}', "tokenizer=null", *TP2_SP[family], "parallel.tensor=2",
        "parallel.sequence_parallel=true", "batch.micro_batch_size=1", "batch.global_batch_size=1"])
    m, s = config.model, config.seq_length
    pctx = ParallelContext.build(config.parallel)
    model = build_model(m, config.parallel, pctx)
    ids = torch.randint(0, m.vocab_size, (1, s + 1), generator=torch.Generator().manual_seed(0))
    recorder = CallGraphRecorder(group_names(pctx))
    with sdpa_kernel(SDPBackend.MATH), recorder:
        with routed_tokens(model) as routed:
            loss = model(ids[:, :-1], labels=ids[:, 1:])
        loss.backward()
    want = hand_forward_flops(model, type(model).__name__, routed, 1, s, m.num_experts_per_tok,
                              m.tie_word_embeddings)
    assert counted(recorder, "forward_flops") == want
    assert counted(recorder, "backward_flops") == {name: 2 * flops for name, flops in want.items()}
    summary = recorder.summary()
    layers: dict[int, int] = {}
    for name, entry in summary["modules"].items():
        tp_bytes = entry.get("collective_bytes", {}).get("TP", 0)
        if tp_bytes and _layer_index(name) is not None:
            layers[_layer_index(name)] = layers.get(_layer_index(name), 0) + tp_bytes
    kinds = ["EmbeddingPipe"] + ["DecoderLayerPipe"] * m.num_hidden_layers + ["FinalNormPipe", "LMHeadPipe"]
    formula = {}
    for index, kind in enumerate(kinds):
        passes = (decoder_layer_transfers(config, index - 1, 1, 4) if kind == "DecoderLayerPipe"
                  else end_layer_transfers(config, kind, 1, 4))
        formula[index] = sum(t.bytes for t in passes[0] + passes[1] if t.group == "TP")
    assert layers == formula  # under SP every layer has TP collectives: the final norm its all-reduce
    whole = rank_step_bytes(config, 2, 0, 4)  # the one pipeline rank
    for key in ("all_gather TP", "reduce_scatter TP"):
        assert summary["collectives"][key]["bytes"] == whole[key], key
    outside = sum(e.get("collective_bytes", {}).get("TP", 0) for name, e in summary["modules"].items()
                  if _layer_index(name) is None)
    assert summary["collectives"]["all_reduce TP"]["bytes"] == whole["all_reduce TP"] + outside

