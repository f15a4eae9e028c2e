"""The bytes this engine's eager (``reference``) kernels read and write per token, counted, not written down.

Eager PyTorch runs a norm, RoPE or SwiGLU as several kernels, each reading and writing whole tensors (an RMSNorm casts
to fp32, squares, averages, multiplies, casts back: some ten times the bytes a fused kernel moves), and its backward
more. The cost model charges this traffic at the memory bandwidth; rather than a hand-kept tally that drifts from the
code, it runs the engine's own decoder layer and loss, forward and backward, on meta tensors (no memory, no
arithmetic) under a dispatch mode that adds up every operator's input and output bytes, except the GEMMs and the
attention kernel (the cost model times those itself) and views (which move nothing).

One TP rank's layer is traced as a one-rank layer of the rank's widths (its heads, KV heads and MLP width, the whole
hidden size); operators on hidden-wide tensors (norms, residual adds) are counted apart, since sequence parallelism
runs them on 1/TP of the tokens. Every operator here is linear in the tokens, so one short sequence gives the bytes
per token. A mixture-of-experts layer is traced as a dense one whose MLP is as wide as the experts a token visits.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from llama_megatron.config import ModelConfig

TOKENS = 64  # the traced sequence: the counts are per token, and every operator is linear in the tokens
# GEMMs (timed by the cost model); a view by another name; allocations, which touch nothing
_NOT_COUNTED = {"mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "_unsafe_view", "empty", "empty_like", "empty_strided",
                "new_empty"}


@dataclasses.dataclass(frozen=True)
class TokenBytes:
    """Bytes per token of the operators on hidden-wide tensors and of the rest, in the forward and the backward."""

    forward_hidden: float
    forward_other: float
    backward_hidden: float
    backward_other: float

    def forward(self, tokens: float, hidden_tokens: float) -> float:
        """Bytes of the forward over ``tokens``, its hidden-wide operators over ``hidden_tokens`` (SP's share)."""
        return self.forward_hidden * hidden_tokens + self.forward_other * tokens

    def backward(self, tokens: float, hidden_tokens: float) -> float:
        return self.backward_hidden * hidden_tokens + self.backward_other * tokens


class _AttentionStandIn(torch.autograd.Function):
    """Where the attention kernel runs (timed by the cost model): an output and gradients of the right shapes that
    move no bytes."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ctx.shapes = (q.shape, k.shape, v.shape)
        return q.new_empty((*q.shape[:-1], v.shape[-1]))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return tuple(grad.new_empty(shape) for shape in ctx.shapes)


class _AttentionKernelAside(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.nn.functional.scaled_dot_product_attention:
            return _AttentionStandIn.apply(*args[:3])
        return func(*args, **(kwargs or {}))


class _CountBytes(TorchDispatchMode):
    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.hidden = self.other = 0
        self.forward: tuple[int, int] = (0, 0)

    def forward_done(self) -> None:
        self.forward = (self.hidden, self.other)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if (func.overloadpacket.__name__ in _NOT_COUNTED
                or any(r.alias_info is not None for r in func._schema.returns)):  # a view
            return out
        tensors = [t for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        if any(t.dim() and t.shape[-1] == self.hidden_size for t in tensors):
            self.hidden += nbytes
        else:
            self.other += nbytes
        return out


def _rank_model(model: ModelConfig, tp: int, moe: bool) -> ModelConfig:
    """A one-rank model of one TP rank's widths (the head dimension kept), of the model's own family (its biases,
    its q/k norms). A mixture-of-experts layer is a dense LLaMA one whose MLP is as wide as the experts each token
    visits (and the shared expert): their SwiGLU's bytes per token; the router's and the token dispatch's own
    operators are data-dependent, which meta tensors cannot run, and are left out."""
    heads, kv = model.num_attention_heads // tp, max(1, model.num_key_value_heads // tp)
    if not moe:
        return dataclasses.replace(model, num_attention_heads=heads, num_key_value_heads=kv, head_dim=model.head_dim,
                                   intermediate_size=model.intermediate_size // tp)
    width = model.num_experts_per_tok * model.expert_intermediate_size + (
        model.shared_intermediate_size)
    return ModelConfig.from_dict({
        "vocab_size": model.vocab_size, "hidden_size": model.hidden_size, "intermediate_size": width // tp,
        "num_hidden_layers": 1, "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": model.head_dim,
        "max_position_embeddings": model.max_position_embeddings, "rms_norm_eps": model.rms_norm_eps,
        "rope_theta": model.rope_theta, "rope_scaling": model.rope_scaling})


def _count(hidden_size: int, run) -> TokenBytes:
    """``run(counter)`` on the meta device (shapes without memory; caches keyed by device keep these apart from real
    tensors), the attention kernel set aside."""
    counter = _CountBytes(hidden_size)
    with torch.device("meta"), _AttentionKernelAside():
        run(counter)
    (hidden, other), total = counter.forward, (counter.hidden, counter.other)
    return TokenBytes(hidden / TOKENS, other / TOKENS, (total[0] - hidden) / TOKENS, (total[1] - other) / TOKENS)


_LAYERS: dict[tuple[str, int, bool], TokenBytes] = {}  # by the model's repr (configs hold dicts: not hashable)


def decoder_layer_bytes(model: ModelConfig, tp: int, moe: bool) -> TokenBytes:
    """Bytes per token one TP rank's decoder layer (MoE or dense) moves outside GEMMs and attention, forward and
    backward, with the reference kernels."""
    key = (repr(model), tp, moe)
    if key not in _LAYERS:
        _LAYERS[key] = _trace_layer(model, tp, moe)
    return _LAYERS[key]


def _trace_layer(model: ModelConfig, tp: int, moe: bool) -> TokenBytes:
    from llama_megatron.model.kernels import REFERENCE
    from llama_megatron.model.layers import DecoderLayerPipe
    from llama_megatron.parallel.context import ParallelContext
    from llama_megatron.parallel.degrees import ParallelConfig

    rank_model = _rank_model(model, tp, moe)

    def run(counter: _CountBytes) -> None:
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)  # bf16 weights, as training holds them
        try:
            layer = DecoderLayerPipe(rank_model, ParallelContext.single(),
                                     ParallelConfig().local_shapes(rank_model), 0, REFERENCE)
        finally:
            torch.set_default_dtype(default)
        hidden = torch.randn(1, TOKENS, model.hidden_size, dtype=torch.bfloat16, requires_grad=True)
        with counter:
            out = layer((hidden, torch.arange(TOKENS)[None]))[0]
            counter.forward_done()
            out.backward(torch.ones_like(out))

    return _count(model.hidden_size, run)


@functools.cache
def loss_bytes(vocab_rows: int, vocab_size: int) -> TokenBytes:
    """Bytes per token of the cross-entropy over one TP rank's ``vocab_rows`` logits, forward and backward, as the
    reference path computes it (fp32 softmax over full logits)."""
    from llama_megatron.parallel.context import ParallelContext
    from llama_megatron.parallel.cross_entropy import vocab_parallel_cross_entropy

    def run(counter: _CountBytes) -> None:
        logits = torch.randn(1, TOKENS, vocab_rows, dtype=torch.bfloat16, requires_grad=True)
        labels = torch.zeros(1, TOKENS, dtype=torch.long)
        with counter:
            loss = vocab_parallel_cross_entropy(logits, labels, ParallelContext.single(), vocab_size, -100).sum()
            counter.forward_done()
            loss.backward()

    return _count(-1, run)  # nothing hidden-wide: all of it in ``*_other``
