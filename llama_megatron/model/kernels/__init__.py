"""The kernel seam: every choice of RMSNorm, RoPE, SwiGLU, attention and loss implementation is made here.

The model's layers receive a :class:`Kernels` at construction (like their process groups) and call its
functions; they hold no device or library branches. Choices (the training JSON's ``"kernels"`` key):

- ``reference``: eager PyTorch, operation for operation HF's LlamaForCausalLM (sdpa). The default on CPU and what
  every parity test pins.
- ``compiled``: ``torch.compile``-fused elementwise kernels (residual add + RMSNorm, RoPE on the fused QKV
  output, SwiGLU), attention without K/V copies (flash-attn, SDPA ``enable_gqa``, FlexAttention for packed
  documents on CUDA: on CPU the dense document mask), the chunked linear + cross-entropy loss that never holds the full
  logits, and a mixture of experts' routed experts as grouped GEMMs (``parallel/grouped_linear.py``) instead of one
  after another.
- ``liger``: as ``compiled`` with Liger-Kernel's Triton kernels for the elementwise work (CUDA, optional extra).
- ``auto``: ``compiled`` on CUDA, ``reference`` elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

import llama_megatron.model.kernels.reference as reference
from llama_megatron.errors import ConfigError
from llama_megatron.model.kernels.attention import FastAttention, ReferenceAttention

KERNEL_CHOICES = ("auto", "reference", "compiled", "liger")


@dataclass(frozen=True)
class Kernels:
    """One implementation per operation; ``name`` is the resolved choice."""

    name: str
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    rotary_qkv: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    swiglu: Callable[[torch.Tensor], torch.Tensor]
    attention: Any  # ReferenceAttention | FastAttention: (q, k, v, segment_ids) -> out
    fused_loss: bool  # chunked linear + cross-entropy (the head hands its input and weight to the loss)
    elementwise: str  # where the norm/RoPE/SwiGLU kernels come from, for the log
    grouped_experts: bool = False  # a mixture of experts' experts as grouped GEMMs, not one after another

    def describe(self, moe: bool = False) -> dict[str, str]:
        """What runs, for the start-up line and the run's metadata (a mixture of experts': how its experts run)."""
        described = {"kernels": self.name, "norm_rope_swiglu": self.elementwise, "attention": self.attention.name,
                     "loss": "chunked linear + cross-entropy" if self.fused_loss else "cross-entropy over full logits"}
        if moe:
            described["experts"] = "grouped GEMMs" if self.grouped_experts else "one after another"
        return described

    def __repr__(self) -> str:  # LayerSpec prints its arguments
        return f"Kernels({self.name})"


REFERENCE = Kernels("reference", reference.rms_norm, reference.add_rms_norm, reference.rotary_qkv,
                    reference.swiglu, ReferenceAttention(), fused_loss=False, elementwise="eager PyTorch")


def kernel_choice(choice: str, device: torch.device | str) -> str:
    """The concrete choice ``choice`` stands for on ``device`` (``auto`` resolved), without importing kernels."""
    if choice not in KERNEL_CHOICES:
        raise ConfigError(f"kernels {choice!r} is not one of {', '.join(KERNEL_CHOICES)}")
    if choice == "auto":
        return "compiled" if torch.device(device).type == "cuda" else "reference"
    return choice


def resolve_kernels(choice: str, device: torch.device | str) -> Kernels:
    """The kernels for the ``kernels`` config value on ``device``; one-line ConfigError when unavailable."""
    choice = kernel_choice(choice, device)
    on_cuda = torch.device(device).type == "cuda"
    if choice == "reference":
        return REFERENCE
    if choice == "compiled":
        import llama_megatron.model.kernels.compiled as ops

        elementwise = "torch.compile"
    else:
        if not on_cuda:
            raise ConfigError("kernels 'liger' needs a CUDA device (Liger-Kernel is Triton on GPUs)")
        try:
            import llama_megatron.model.kernels.liger as ops
        except ImportError as exc:
            raise ConfigError(f"kernels 'liger' needs liger-kernel (pip install -e \".[gpu]\"): {exc}") from None
        elementwise = "Liger-Kernel"
    return Kernels(choice, ops.rms_norm, ops.add_rms_norm, ops.rotary_qkv, ops.swiglu, FastAttention(),
                   fused_loss=True, elementwise=elementwise, grouped_experts=True)
