"""Liger-Kernel's Triton kernels (CUDA only; the optional extra ``pip install -e ".[gpu]"``).

HF's cast order ('llama' casting mode) throughout. Liger's RoPE takes q/k as [b, heads, s, d] views and its
fused gate/up SwiGLU a 2-D [tokens, 2 * ffn] tensor (its backward returns a 2-D gradient).
"""

from __future__ import annotations

import torch
from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction
from liger_kernel.ops.rms_norm import LigerRMSNormFunction
from liger_kernel.ops.rope import LigerRopeFunction
from liger_kernel.ops.swiglu import LigerFusedGateUpSiLUMulFunction

from llama_megatron.model.kernels.reference import split_qkv


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return LigerRMSNormFunction.apply(x, weight, eps, 0.0, "llama", False)


def add_rms_norm(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    normed, total = LigerFusedAddRMSNormFunction.apply(x, residual, weight, eps, 0.0, "llama", False)
    return total, normed


def rotary_qkv(qkv: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q, k, v = split_qkv(qkv)
    q, k = LigerRopeFunction.apply(q.transpose(1, 2), k.transpose(1, 2), cos.to(q.dtype), sin.to(q.dtype))
    return q.transpose(1, 2), k.transpose(1, 2), v


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    *lead, width = gate_up.shape
    return LigerFusedGateUpSiLUMulFunction.apply(gate_up.reshape(-1, width)).view(*lead, width // 2)
