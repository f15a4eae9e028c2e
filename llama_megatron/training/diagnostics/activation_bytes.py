"""What autograd keeps for the backward of this repository's layers, per rank (the activation side of
``llama-megatron estimate``: training/diagnostics/memory_estimate.py): each decoder layer's saved tensors for the
reference or the fast kernels, dense or MoE, under TP, SP and CP; the spans recomputation keeps; the logits and the
loss; and what a split backward (B now, W later: zero-bubble schedules) keeps queued until its W runs. Checked
against real autograd in tests/test_training_estimate.py.
"""

from __future__ import annotations

from collections.abc import Callable

from llama_megatron.model.lora_layout import (
    EXPERT_TARGETS,
    TARGETS,
    layer_target,
    saved_module_specs,
    target_shapes,
)
from llama_megatron.parallel.linear_cross_entropy import default_chunk_tokens
from llama_megatron.training.config import TrainingConfig
from llama_megatron.training.objectives import objective_of


def _decoder_layer_bytes(config: TrainingConfig, b: int, e: int, fast: bool) -> tuple[int, int]:
    """Saved-for-backward bytes of one decoder layer, per TP and CP rank (llama_megatron/model/*.py), where a model
    has layers of several kinds (dense and MoE: Qwen's ``mlp_only_layers``, Llama 4's alternate layers; RoPE and
    NoPE): (the largest kind's, the mean over the layers, rounded up). A recomputed span's peak is counted with the
    first, the layers a stage keeps with the second (a stage's share of an alternating pattern)."""
    m = config.model
    kinds = [(m.is_moe_layer(i), m.family.rope(m, i), m.family.l2_qk_norm(m, i), m.family.temperature(m, i))
             for i in range(m.num_hidden_layers)]
    sizes = {kind: _layer_bytes(config, b, e, fast, *kind) for kind in set(kinds)}
    return max(sizes.values()), -(-sum(sizes[kind] for kind in kinds) // len(kinds))


def _layer_bytes(config: TrainingConfig, b: int, e: int, fast: bool, moe: bool, rope: bool = True,
                 l2_qk_norm: bool = False, temperature: bool = False) -> int:
    """:func:`_decoder_layer_bytes` of a dense (``moe`` False) or an MoE decoder layer; Llama 4's per layer: RoPE or
    none, the q/k L2 norm (the fp32 q and k it normalises, an fp32 rsqrt per head), the temperature (the queries it
    scales, a scale per token)."""
    m, t, s, cp = config.model, config.parallel.tensor, config.seq_length, config.parallel.context
    sp = config.parallel.sequence_parallel
    h, hd = m.hidden_size, m.head_dim
    tokens = b * s // cp
    norms = 2 * _norm_bytes(tokens, h, t if sp else 1, e, fast)  # input and post-attention norms
    local = config.local_shapes
    q_width = local.heads * hd
    lse = 4 * tokens * local.heads  # the attention kernel's fp32 logsumexp per head
    kv_width = local.kv_heads * local.kv_repeats * hd
    if m.qk_norm:  # Qwen3's q and k norms, on this rank's heads (their outputs feed RoPE, not a linear)
        norms += _norm_bytes(tokens, (local.heads + local.kv_heads) * hd, 1, e, fast, feeds_linear=False)
    ulysses = e * tokens * q_width if cp > 1 else 0  # the output after the all-to-all back (o_proj's input)
    swiglu = 3 if fast else 4  # gate_up output (2f), product; the reference path keeps the silu output too
    if fast:  # q, k, v (K/V heads not repeated, unless for the CP all-to-all) and the output
        attention = e * tokens * (2 * q_width + 2 * kv_width) + lse + ulysses
        rotary = 2 * e * tokens * hd if e != 4 else 0  # cos and sin cast to bf16 (fp32: the shared tensors)
    else:  # SDPA saves q, k and v (k, v repeated to the query heads) and its output
        attention = 4 * e * tokens * q_width + lse + ulysses
        rotary = 4 * e * tokens * hd if e != 4 else 0  # cos and sin cast to bf16 once per q and k
    mlp = swiglu * e * tokens * local.intermediate
    if moe:  # every TP rank routes the whole (SP-gathered) sequence of its CP shard
        rows = tokens * m.num_experts_per_tok  # assignments, balanced over the EP ranks' experts
        # fp32 probabilities and top-k weights, the int64 expert ids and permutations
        router = 4 * tokens * m.num_local_experts + 4 * tokens + rows * (8 * 4 + 4 * 3)
        mlp = router + swiglu * e * rows * local.expert_intermediate + 2 * e * rows * h  # + experts' inputs, outputs
        if local.shared_intermediate:  # the shared expert (a SwiGLU on every token), its output and its gate's
            # logit and sigmoid, both kept by the product that scales it (Llama 4's is ungated: its output only)
            gated = m.family.moe.shared_expert_gated
            mlp += swiglu * e * tokens * local.shared_intermediate + gated * (e * tokens * h + 2 * e * tokens)
    if not rope:
        rotary = 0
    if l2_qk_norm:
        heads = local.heads + local.kv_heads
        norms += 4 * tokens * heads * hd + 4 * tokens * heads
    if temperature:
        attention += e * tokens * q_width + 4 * tokens
    return norms + attention + rotary + mlp


def deferred_weight_grad_bytes(config: TrainingConfig, kinds: list[str], b: int, e: int, fast: bool) -> int:
    """What a stage's W pass keeps from its B for one micro batch, per TP and CP rank (parallel/weight_grad.py):
    the input and the output gradient of each linear whose weight trains, and the norms' weight gradients. Per
    decoder layer the fused linears of the LoRA target table (qkv, o, gate_up, down; under SP the inputs are the
    all-gathered sequences, the row-parallel outputs' gradients the full sequence before the reduce-scatter); the
    LM head of the reference path, its own or the tied table (the fused loss computes the weight's gradient in
    its forward). The inputs share their storage with the forward's saved tensors, which the B frees otherwise.
    LoRA (the base frozen): the adapters' inputs, their rank-wide intermediates and gradients, and the gradients
    of the adapted outputs, and what full training keeps for the modules to save (the norms' weight gradients, the
    head's input and output gradient).

    An MoE layer's MLP (full-parameter runs): the router's input (the whole, SP-gathered sequence) and its logits'
    gradient; per routed assignment (balanced routing: k x tokens rows on this EP rank's experts) each expert's
    input, its gate/up output gradient, its down input and output gradient; the shared expert's linears on every
    token (their input the router's) and its gate's one logit. LoRA in an MoE layer: the adapters of the shared
    expert (what PEFT's MLP names adapt there) on every token, and those on the routed experts' parameters per
    assignment. Where a model mixes dense and MoE layers, a stage keeps its share of the layers' widths (the
    mean per layer: exact at PP 1)."""
    m = config.model
    tokens = b * config.seq_length // config.parallel.context
    trains = _trained_rows(config)
    head = 0
    if "FinalNormPipe" in kinds:  # the final norm's weight gradient, and the head's
        head = e * m.hidden_size if trains("norm.weight") else 0
        if not fast and trains("embed.weight" if m.tie_word_embeddings else "lm_head.weight"):
            head += e * tokens * (m.hidden_size + config.local_shapes.vocab_rows)
    # the two norms' weight gradients, and Qwen3's q and k norms' (a head_dim weight each); every layer alike
    norms = sum(e * m.hidden_size for norm in ("input_layernorm", "post_attention_layernorm")
                if trains(f"layers.0.{norm}.weight"))
    if m.qk_norm:
        norms += sum(e * m.head_dim for norm in ("q_norm", "k_norm") if trains(f"layers.0.self_attn.{norm}.weight"))
    layers, total_widths = kinds.count("DecoderLayerPipe"), _deferred_layer_widths(config)
    # a stage's share of the layers' widths (all of them at PP 1; the mean per layer where kinds alternate)
    return layers * norms + -(-layers * e * tokens * total_widths // config.model.num_hidden_layers) + head


_WIDTHS: dict[tuple, tuple] = {}


def _deferred_layer_widths(config: TrainingConfig) -> int:
    """:func:`_deferred_widths` summed over the decoder layers, kept for the model last asked about (a function of
    the model, TP, the expert split and LoRA only; the planner asks for it once per layout)."""
    par = config.parallel
    key = (id(config.model), id(config.lora), par.tensor, par.expert, par.context)
    seen = _WIDTHS.get(key)
    if seen is None or seen[0] is not config.model or seen[1] is not config.lora:
        if len(_WIDTHS) > 64:
            _WIDTHS.clear()
        total = sum(_deferred_widths(config, layer) for layer in range(config.model.num_hidden_layers))
        seen = _WIDTHS[key] = (config.model, config.lora, total)
    return seen[2]


def _trained_rows(config: TrainingConfig) -> Callable[[str], bool]:
    """Whether the base row of a canonical name trains: every one in full training, a LoRA run's modules to save."""
    if config.lora is None:
        return lambda name: True
    saved = {spec.name for spec in saved_module_specs(config.model, config.lora)}
    return saved.__contains__


def _deferred_widths(config: TrainingConfig, layer: int) -> int:
    """Per token, the elements decoder layer ``layer``'s W keeps (:func:`deferred_weight_grad_bytes`)."""
    m, t, lora = config.model, config.parallel.tensor, config.lora
    moe = m.is_moe_layer(layer)
    fused: dict[str, list[str]] = {}  # each fused linear of this layer: its HF targets
    for name in TARGETS:
        target = layer_target(m, layer, name) if lora is not None else TARGETS[name]
        if target is not None and not (lora is None and moe and target.linear.startswith("mlp.")):
            fused.setdefault(target.linear, []).append(name)
    widths = 0
    for names in fused.values():
        column = TARGETS[names[0]].parallel == "column"
        outputs = {name: target_shapes(m, name, layer)[0] // (t if column else 1) for name in names}  # local widths
        width = target_shapes(m, names[0], layer)[1] // (1 if column else t)  # the fused linear's local input
        if lora is None:
            widths += width + sum(outputs.values())
            continue
        adapted = [name for name in names if name in lora.targets]
        if adapted:  # A: the input (one dropped-out copy per target of a column linear) and its rank-wide output
            # and gradient; B: the gradient of each adapted target's output
            copies = len(adapted) if lora.dropout and column else 1
            widths += copies * width + 2 * lora.rank * len(adapted) + sum(outputs[a] for a in adapted)
    if moe and lora is None:
        widths += _moe_mlp_widths(config)
    elif moe:  # adapters on the routed experts' parameters: per assignment, as the experts' own linears
        f = config.local_shapes.expert_intermediate
        per_row = {EXPERT_TARGETS[0]: m.hidden_size + 2 * f, EXPERT_TARGETS[1]: f + m.hidden_size}
        widths += m.num_experts_per_tok * sum(io + 2 * lora.rank for name, io in per_row.items()
                                              if name in lora.targets)
    return widths


def _moe_mlp_widths(config: TrainingConfig) -> int:
    """Per token, what a full-parameter MoE layer's MLP keeps for its W (:func:`deferred_weight_grad_bytes`)."""
    m, local = config.model, config.local_shapes
    h, f = m.hidden_size, local.expert_intermediate
    widths = h + m.num_local_experts + m.num_experts_per_tok * (h + 2 * f + f + h)
    if local.shared_intermediate:  # its gate_up reads the router's input; a gate's one logit (Qwen2-MoE)
        widths += 2 * local.shared_intermediate + local.shared_intermediate + h + m.family.moe.shared_expert_gated
    return widths


def _norm_bytes(tokens: int, h: int, shard: int, e: int, fast: bool, feeds_linear: bool = True) -> int:
    """An RMSNorm on its tokens (``shard`` = TP under SP, else 1) and, when ``feeds_linear``, the input of the
    column-parallel linear after it (the norm's output, or under SP the all-gathered full sequence). Reference:
    fp32 input (pow), normalised value and fp32 rsqrt; fused kernels: the input and the fp32 rsqrt."""
    norm = ((e if fast else 4 + e) * tokens * h + 4 * tokens) // shard
    return norm + (e * tokens * h if feeds_linear else 0)


def checkpoint_spans(kinds: list[str], interval: int, pipelined: bool) -> list[tuple[int, bool]]:
    """(decoder layers, recomputed) per checkpoint span, as PipelineModule / LlamaCausalLM form them."""
    if not interval:
        return [(kinds.count("DecoderLayerPipe"), False)]
    if pipelined:  # PipelineModule: fixed windows of `interval` layers; recomputed when all are decoder layers
        windows = [kinds[i:i + interval] for i in range(0, len(kinds), interval)]
        return [(w.count("DecoderLayerPipe"), all(k == "DecoderLayerPipe" for k in w)) for w in windows]
    n = kinds.count("DecoderLayerPipe")  # LlamaCausalLM: runs of `interval` decoder layers
    return [(min(interval, n - i), True) for i in range(0, n, interval)]


def activations(config: TrainingConfig, kinds: list[str], b: int, e: int,
                 pipelined: bool, fast: bool) -> tuple[int, int, int]:
    """Bytes on a stage with ``kinds`` for one micro batch: (saved for backward, recomputed span, logits/loss)."""
    m, t, s = config.model, config.parallel.tensor, config.seq_length
    sp = config.parallel.sequence_parallel
    ids = 8 * b * s  # int64 position ids: full length on every rank, also under CP
    tokens = b * s // config.parallel.context  # this CP rank's tokens
    hidden_local = tokens * m.hidden_size // (t if sp else 1)
    layer, mean_layer = _decoder_layer_bytes(config, b, e, fast)
    saved = 0
    worst_span = 0
    for count, recomputed in checkpoint_spans(kinds, config.activation_checkpointing.interval, pipelined):
        if recomputed:  # the span's input stays; its layers' activations exist again during its backward
            saved += e * hidden_local
            worst_span = max(worst_span, count * layer)
        else:
            saved += count * mean_layer
    saved += ids if worst_span else 0  # position ids, an input of every recomputed span
    if "DecoderLayerPipe" in kinds:  # RoPE's fp32 cos and sin, made once per micro batch for the stage
        saved += 8 * tokens * m.head_dim
    if "EmbeddingPipe" == kinds[0]:
        saved += 8 * tokens + (tokens if t > 1 else 0)  # token ids, the out-of-shard mask
    logits = 0
    if "FinalNormPipe" in kinds:  # the last stage: final norm, head (own or tied table) and loss
        local = config.local_shapes
        vocab_local = local.vocab_rows
        padded = local.padded_vocab_size > m.vocab_size
        # the chunked loss keeps d(loss)/d(head input) and d(loss)/d(weight) (fp32) from its forward; an objective
        # weighting each token's gradient by its sequence's (preference pairs) takes the whole logits whatever the
        # kernels
        if fast and not objective_of(config).whole_logits:
            saved += _norm_bytes(tokens, m.hidden_size, t if sp else 1, e, fast, feeds_linear=False)
            saved += e * tokens * m.hidden_size + 4 * vocab_local * m.hidden_size
            chunk = min(tokens, default_chunk_tokens(tokens, vocab_local, m.hidden_size))
            logits = chunk * vocab_local * (4 + (2 * e if e != 4 else 0))  # one chunk: matmul, fp32, grad cast
        else:
            saved += _norm_bytes(tokens, m.hidden_size, t if sp else 1, e, fast)  # final norm + the head's input
            saved += 4 * tokens * vocab_local + 10 * tokens  # fp32 softmax kept by the vocab-parallel CE, targets
            # logits (kept by the pipeline engine until backward) + the CE's transient fp32 copies: cast (bf16),
            # padding clone and shifted logits
            logits = tokens * vocab_local * (e + 4 + (4 if e != 4 else 0) + (4 if padded else 0))
    if pipelined:  # payload buffers DeepSpeed keeps per in-flight micro batch
        partitioned = t > 1 and not sp and config.parallel.pipeline > 1
        if kinds[0] != "EmbeddingPipe" and not partitioned:
            saved += e * hidden_local + ids  # received input (the forward runs on a clone)
        if "FinalNormPipe" not in kinds:
            saved += e * hidden_local // (t if partitioned else 1) + ids  # sent output
    return saved, worst_span, logits


def fp8_transient_bytes(config: TrainingConfig, rows: int) -> int:
    """The float8 operands one FP8 GEMM holds at once, at the largest selected linear (the ones ``fp8`` selects,
    filter included, each projection of a fused weight its own GEMM): 1 byte an element for the two operands
    (forward: input and weight; input gradient: output gradient and weight; weight gradient: output gradient and
    input) and 4 bytes a scale (rowwise: one per row of each; tensorwise: one). Tokens are a micro batch's whole
    sequence on a CP rank's share (SP gathers it before a column-parallel GEMM)."""
    from llama_megatron.model.build import selected_float8_linears

    tp = config.parallel.tensor
    tokens = rows * config.seq_length // config.parallel.context
    worst = 0
    for _, split, parts, cols in selected_float8_linears(config.model, config.fp8):
        for part in parts:  # (k, n) of each projection's GEMM on a TP rank
            k, n = (cols // tp, part) if split == "row" else (cols, part // tp)
            elements = max(tokens * k + k * n, tokens * n + k * n, tokens * n + tokens * k)
            worst = max(worst, elements + 4 * (2 * tokens + k + n))
    return worst
