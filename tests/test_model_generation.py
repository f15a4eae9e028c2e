"""A group of completions of one prompt decoded as one batch (online RL's rollouts) against transformers'
``generate`` with ``num_return_sequences`` on the same weights, in this process: greedy and seeded sampling give
HF's tokens row for row (a row that reaches the stop id ends there while the others go on), and the sampler's
log-probability of each token is HF's (its logits at that step, over the temperature)."""

from __future__ import annotations

import pytest
import torch
from family_cases import MOE_PARITY
from model_utils import hf_model, tiny_config

from llama_megatron.config import ModelConfig
from llama_megatron.model.build import build_model
from llama_megatron.model.generation import Sampling, generate_rows
from llama_megatron.model.param_layout import as_checkpoint_tensors
from llama_megatron.model.tp_slicing import hf_to_rank_state_dict
from llama_megatron.parallel.context import ParallelContext
from llama_megatron.parallel.degrees import ParallelConfig

PROMPT = [1, 17, 90, 33, 5, 61]
ROWS, NEW = 4, 12


def _models(config: ModelConfig):
    hf = hf_model(config, seed=5).eval()
    parallel = ParallelConfig()
    ours = build_model(config, parallel, ParallelContext.single(), initialize=False)
    state = hf_to_rank_state_dict(as_checkpoint_tensors(hf.state_dict(), config), config, 0, 1,
                                  parallel.padded_vocab_size(config.vocab_size))
    ours.load_state_dict({k: state[k] for k in ours.state_dict()})
    return hf, ours.eval()


def _hf_rows(hf, sampling: Sampling, stop: int | None) -> tuple[list[list[int]], list[list[float]]]:
    """HF's rows cut after their first stop id, and log_softmax(logits / T) of each kept token."""
    options = dict(do_sample=False) if sampling.temperature == 0 else dict(
        do_sample=True, temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p)
    torch.manual_seed(sampling.seed)  # HF draws from the global generator; ours from a generator of that seed
    out = hf.generate(torch.tensor([PROMPT] * ROWS), max_new_tokens=NEW, eos_token_id=stop,
                      pad_token_id=0, output_logits=True, return_dict_in_generate=True, **options)
    temperature = sampling.temperature or 1.0
    rows, logprobs = [], []
    for row in range(ROWS):
        tokens = out.sequences[row, len(PROMPT):].tolist()
        if stop in tokens:
            tokens = tokens[:tokens.index(stop) + 1]
        rows.append(tokens)
        logprobs.append([float(torch.log_softmax(out.logits[i][row].float() / temperature, -1)[t])
                         for i, t in enumerate(tokens)])
    return rows, logprobs


@pytest.mark.parametrize("case", ["gqa", "deepseek-v3"])
def test_a_group_of_rows_equals_hf_generate_greedy_and_sampled(case: str) -> None:
    """Grouped-query attention's cache of keys and values; DeepSeek-V3's of its latents (a kv latent and the shared
    rotated key per position, the heads' keys and values expanded from them each step) against HF's cache of the
    expanded keys and values."""
    config = tiny_config(**({"num_key_value_heads": 2} if case == "gqa" else MOE_PARITY[case]))
    hf, ours = _models(config)
    for sampling in (Sampling(), Sampling(temperature=1.3, top_k=40, top_p=0.9, seed=11)):
        free, _ = _hf_rows(hf, sampling, None)
        # a stop id that one row reaches early (a sampled row's fourth token), so rows end at different steps
        stop = free[-1][3]
        want, want_logprobs = _hf_rows(hf, sampling, stop)
        got = generate_rows(ours, PROMPT, ROWS, NEW, {stop}, sampling)
        assert got.tokens == want, sampling
        assert got.truncated == [stop not in row for row in want]
        if sampling.temperature:
            assert any(len(row) < NEW for row in want) and any(len(row) == NEW for row in want), want
        # fp32 logits of the same weights in another order of operations: 1e-5 of a log-probability
        for ours_row, hf_row in zip(got.logprobs, want_logprobs, strict=True):
            assert torch.allclose(torch.tensor(ours_row), torch.tensor(hf_row), atol=1e-5), (ours_row, hf_row)
        no_cache = generate_rows(ours, PROMPT, ROWS, NEW, {stop}, sampling, use_cache=False)
        assert no_cache.tokens == got.tokens
