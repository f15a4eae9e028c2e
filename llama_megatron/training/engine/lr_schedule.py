"""Learning-rate schedule: linear warmup from 0, then cosine or linear decay to ``min_lr`` (Megatron's shape)."""

from __future__ import annotations

import math

import torch

from llama_megatron.training.config import OptimizerConfig


def lr_at(step: int, opt: OptimizerConfig, total_steps: int) -> float:
    """Learning rate for optimizer step ``step`` (0-based: the first update uses ``lr_at(0)``)."""
    warmup = opt.warmup_steps
    if warmup and step < warmup:
        return opt.lr * (step + 1) / warmup
    if opt.decay_style == "constant":
        return opt.lr
    decay_steps = opt.decay_steps or max(total_steps - warmup, 1)
    progress = min(max(step - warmup, 0) / decay_steps, 1.0)
    if opt.decay_style == "linear":
        coeff = 1.0 - progress
    else:
        coeff = 0.5 * (1.0 + math.cos(math.pi * progress))
    return opt.min_lr + (opt.lr - opt.min_lr) * coeff


def build_scheduler(optimizer: torch.optim.Optimizer, opt: OptimizerConfig,
                    total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    base = opt.lr

    def factor(step: int) -> float:
        return lr_at(step, opt, total_steps) / base if base else 0.0

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
