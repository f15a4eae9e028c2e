"""Autoregressive decoding with this model (PP=1, any TP): greedy by default, or sampling with temperature,
top-k and top-p as transformers' ``generate`` applies them; stops at any of the stop ids.

With the KV cache, the prompt is run once and every new token attends to the cached keys and values of the
earlier positions; without it, every step runs the whole sequence again (the same logits, for checking).
Under TP every rank computes the same full logits (the vocab shards are gathered), and the token chosen by TP
rank 0 is broadcast, so all ranks continue with the same sequence.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from llama_megatron.model.kv_cache import KVCache
from llama_megatron.model.llama import LlamaCausalLM


@dataclass
class Sampling:
    """``temperature`` 0 means greedy (argmax); otherwise logits / temperature, then top-k, then top-p."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def choose(self, logits: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        """Next token ids [b] from fp32 logits [b, vocab]."""
        if self.temperature <= 0:
            return logits.argmax(dim=-1)
        logits = logits / self.temperature
        if self.top_k > 0:
            kth = torch.topk(logits, min(self.top_k, logits.shape[-1])).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if self.top_p < 1.0:
            ascending, order = torch.sort(logits, dim=-1)
            cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
            drop = cumulative <= 1 - self.top_p  # HF's rule: keep the smallest set whose mass exceeds top_p
            drop[..., -1] = False
            logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
        return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(model: LlamaCausalLM, prompt: list[int], max_new_tokens: int, stop_ids: set[int],
             sampling: Sampling | None = None, use_cache: bool = True,
             stop_when: Callable[[list[int]], bool] | None = None) -> list[int]:
    """The new tokens after ``prompt`` (a stop id, when reached, is the last one returned; so is the token after
    which ``stop_when(new tokens)`` holds: a stop sequence in their text). Every TP rank returns the same tokens."""
    sampling = sampling or Sampling()
    config, pctx = model.config, model.pctx
    device = next(model.parameters()).device
    generator = None
    if sampling.temperature > 0:
        generator = torch.Generator(device=device).manual_seed(sampling.seed)
    tokens = torch.tensor([prompt], dtype=torch.long, device=device)
    cache = None
    if use_cache:
        dtype = next(model.parameters()).dtype
        cache = KVCache(config.num_hidden_layers, 1, len(prompt) + max_new_tokens, model.shapes.kv_heads,
                        config.head_dim, dtype, device, config.layer_chunks())
    new: list[int] = []
    step_input, start = tokens, 0
    for _ in range(max_new_tokens):
        positions = torch.arange(start, start + step_input.shape[1], device=device).unsqueeze(0)
        local = model.forward_cached(step_input, positions, cache) if cache else model(step_input, positions)
        logits = model.full_logits(local[:, -1]).float()
        token = sampling.choose(logits, generator)
        if pctx.tp_size > 1:  # one choice for every TP rank, whatever their sampling does
            dist.broadcast(token, src=dist.get_global_rank(pctx.tp_group, 0), group=pctx.tp_group)
        new.append(int(token))
        if new[-1] in stop_ids or (stop_when is not None and stop_when(new)):
            break
        tokens = torch.cat([tokens, token.view(1, 1)], dim=1)
        step_input, start = (token.view(1, 1), tokens.shape[1] - 1) if cache else (tokens, 0)
    return new
