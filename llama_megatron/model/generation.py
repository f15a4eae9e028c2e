"""Autoregressive decoding with this model (any TP; a pipeline through staged_inference.py): greedy by default, or
sampling with temperature, top-k and top-p as transformers' ``generate`` applies them; stops at any of the stop
ids. One prompt's rows decode as one batch (:func:`generate_rows`: online RL's group of completions).

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


@dataclass
class Completions:
    """A batch of rows decoded from one prompt: each row's new tokens (a stop id, where reached, the last), the
    sampler's log-probability of each (of its logits / temperature before top-k and top-p, as a training pass at
    that temperature computes it: what the rollout/training mismatch is measured on) and whether the row ended
    without reaching a stop (``max_new_tokens`` used up)."""

    tokens: list[list[int]]
    logprobs: list[list[float]]
    truncated: list[bool]


@torch.no_grad()
def generate_rows(model: LlamaCausalLM, prompt: list[int], rows: int, max_new_tokens: int, stop_ids: set[int],
                  sampling: Sampling | None = None, use_cache: bool = True,
                  stop_when: Callable[[list[int]], bool] | None = None,
                  generator: torch.Generator | None = None, lockstep=None) -> Completions:
    """``rows`` completions of ``prompt`` decoded as one batch (the prompt's K/V computed once per row, as
    transformers' ``generate`` does for ``num_return_sequences``): every step samples each row's next token, so
    the random draws are HF's for the same probabilities and seed; a row that reached a stop id (or after which
    ``stop_when`` holds) keeps its tokens while the others go on, and decoding ends when every row has. Sampling
    draws from ``generator`` (default: a new one seeded ``sampling.seed``). Every TP rank returns the same
    tokens. ``lockstep``: a process group whose ranks decode other prompts but share collectives inside the forward
    (ZeRO-3's gathers, the experts' all-to-all): each decodes until every one of them is done."""
    sampling = sampling or Sampling()
    config, pctx = model.config, model.pctx
    device = next(model.parameters()).device
    if generator is None and sampling.temperature > 0:
        generator = torch.Generator(device=device).manual_seed(sampling.seed)
    tokens = torch.tensor([prompt], dtype=torch.long, device=device).expand(rows, -1)
    cache = None
    if use_cache:
        dtype = next(model.parameters()).dtype
        heads, key_dim, value_dim = config.kv_cache_widths(pctx.tp_size)
        cache = KVCache(config.num_hidden_layers, rows, len(prompt) + max_new_tokens, heads, key_dim, dtype, device,
                        config.layer_chunks(), value_dim)
    new: list[list[int]] = [[] for _ in range(rows)]
    logprobs: list[list[float]] = [[] for _ in range(rows)]
    running = [True] * rows
    step_input, start = tokens, 0
    temperature = sampling.temperature if sampling.temperature > 0 else 1.0
    for _ in range(max_new_tokens):
        positions = torch.arange(start, start + step_input.shape[1], device=device).expand(rows, -1)
        local = model.forward_cached(step_input, positions, cache) if cache else model(step_input, positions)
        logits = model.full_logits(local[:, -1]).float()
        token = sampling.choose(logits, generator)
        if pctx.tp_size > 1:  # one choice for every TP rank, whatever their sampling does
            dist.broadcast(token, src=dist.get_global_rank(pctx.tp_group, 0), group=pctx.tp_group)
        chosen = torch.log_softmax(logits / temperature, dim=-1).gather(-1, token[:, None]).squeeze(-1)
        for row, (value, logprob) in enumerate(zip(token.tolist(), chosen.tolist())):
            if running[row]:
                new[row].append(value)
                logprobs[row].append(logprob)
                running[row] = value not in stop_ids and not (stop_when is not None and stop_when(new[row]))
        if not _any_running(running, lockstep, device):
            break
        tokens = torch.cat([tokens, token[:, None]], dim=1)
        step_input, start = (token[:, None], tokens.shape[1] - 1) if cache else (tokens, 0)
    return Completions(new, logprobs, running)


def _any_running(running: list[bool], lockstep, device: torch.device) -> bool:
    """Whether a row is still decoding here, or (``lockstep``) on any rank of that group."""
    if lockstep is None:
        return any(running)
    flag = torch.tensor([float(any(running))], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=lockstep)
    return bool(flag.item())


def generate(model: LlamaCausalLM, prompt: list[int], max_new_tokens: int, stop_ids: set[int],
             sampling: Sampling | None = None, use_cache: bool = True,
             stop_when: Callable[[list[int]], bool] | None = None) -> list[int]:
    """The new tokens after ``prompt`` (a stop id, when reached, is the last one returned; so is the token after
    which ``stop_when(new tokens)`` holds: a stop sequence in their text). Every TP rank returns the same tokens."""
    return generate_rows(model, prompt, 1, max_new_tokens, stop_ids, sampling, use_cache, stop_when).tokens[0]
