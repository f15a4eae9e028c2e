"""SwiGLU MLP: ``down(silu(gate(x)) * up(x))`` with gate and up fused into one column-parallel matmul.

Per TP rank the fused weight is ``cat([gate[rank rows], up[rank rows]])`` (Megatron's layout), so the local
output splits into gate and up halves with no communication.
"""

from __future__ import annotations

import torch
from torch import nn

from llama_megatron.config import ModelConfig
from llama_megatron.model.kernels import REFERENCE, Kernels
from llama_megatron.parallel.context import ParallelContext
from llama_megatron.parallel.layers import ColumnParallelLinear, RowParallelLinear


def gate_up_parts(rows: int) -> list[torch.Tensor]:
    """The gate and up rows of a fused gate/up weight of ``rows`` local rows (gate first): the projections FP8
    scales apart (:mod:`llama_megatron.parallel.float8`)."""
    return list(torch.arange(rows).split(rows // 2))


class ParallelMLP(nn.Module):
    def __init__(self, config: ModelConfig, pctx: ParallelContext, kernels: Kernels = REFERENCE) -> None:
        super().__init__()
        self.kernels = kernels
        ffn = config.dense_intermediate_size
        self.gate_up_proj = ColumnParallelLinear(config.hidden_size, 2 * ffn, pctx, "gate_up", bias=config.mlp_bias)
        self.gate_up_proj.output_parts = gate_up_parts(self.gate_up_proj.out_features_per_rank)
        self.down_proj = RowParallelLinear(ffn, config.hidden_size, pctx, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.kernels.swiglu(self.gate_up_proj(x)))
