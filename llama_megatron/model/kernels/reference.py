"""Reference kernels: eager PyTorch, operation for operation what ``transformers.LlamaForCausalLM`` computes.

The default on CPU and what every parity test pins; each fast kernel is tested against these.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llama_megatron.model.rope import apply_rotary


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``w * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(x.dtype)`` (HF multiplies after casting back)."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def add_rms_norm(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the next norm: ``(residual + x, rms_norm(residual + x))``."""
    total = residual + x
    return total, rms_norm(total, weight, eps)


def split_qkv(qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused QKV output [b, s, kv_groups, g + 2, head_dim] -> q [b, s, kv_groups * g, d], k and v [b, s, kv_groups,
    d] (views where the layout allows)."""
    b, s, groups, width, head_dim = qkv.shape
    g = width - 2
    return qkv[:, :, :, :g].reshape(b, s, groups * g, head_dim), qkv[:, :, :, g], qkv[:, :, :, g + 1]


def rotary_qkv(qkv: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k (rotated) and v from the fused QKV output; cos/sin [b, s, head_dim] fp32."""
    q, k, v = split_qkv(qkv)
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v.contiguous()


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` on the fused ``[gate | up]`` last dimension."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
