"""Same seed, same model: every TP/PP layout initialises exactly the TP1-PP1 weights, sliced."""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_distributed
from model_utils import tiny_config

from llama_megatron.model.build import build_model
from llama_megatron.model.param_layout import ParamLayout
from llama_megatron.model.tp_slicing import rank_state_dicts_to_hf, shard_for_rank
from llama_megatron.parallel.context import ParallelContext
from llama_megatron.parallel.degrees import ParallelConfig

SEED = 1234
CONFIG = dict(num_key_value_heads=4, vocab_size=250, num_hidden_layers=4)


def _reference_hf(config) -> dict[str, torch.Tensor]:
    model = build_model(config, ParallelConfig(make_vocab_size_divisible_by=8), ParallelContext.single(), seed=SEED)
    return rank_state_dicts_to_hf([model.state_dict()], config)


def test_tensor_parallel_init_is_sliced_tp1_init() -> None:
    """Building a TP rank needs no communication, so every rank of TP 2/4 is built here in one process."""
    for tied in (False, True):
        config = tiny_config(**CONFIG, tie_word_embeddings=tied)
        reference = _reference_hf(config)
        for tp in (2, 4):
            parallel = ParallelConfig(tensor=tp, make_vocab_size_divisible_by=8)
            states = []
            for rank in range(tp):
                pctx = ParallelContext(tp_size=tp, tp_rank=rank, world_size=tp, rank=rank)
                states.append(build_model(config, parallel, pctx, seed=SEED).state_dict())
            merged = rank_state_dicts_to_hf(states, config)
            assert merged.keys() == reference.keys()
            for name, tensor in reference.items():
                assert torch.equal(merged[name], tensor), f"tp={tp} {name}"


def test_seed_changes_weights() -> None:
    config = tiny_config(**CONFIG)
    a = build_model(config, ParallelConfig(make_vocab_size_divisible_by=8), ParallelContext.single(), seed=1)
    b = build_model(config, ParallelConfig(make_vocab_size_divisible_by=8), ParallelContext.single(), seed=2)
    assert not torch.equal(a.state_dict()["1.self_attn.qkv_proj.weight"], b.state_dict()["1.self_attn.qkv_proj.weight"])


def _pipeline_worker(rank: int, world_size: int, tp: int, pp: int, tied: bool) -> None:
    from llama_megatron.parallel.process_groups import init_distributed

    init_distributed()
    config = tiny_config(**CONFIG, tie_word_embeddings=tied)
    reference = _reference_hf(config)
    parallel = ParallelConfig(tensor=tp, pipeline=pp, make_vocab_size_divisible_by=8)
    pctx = ParallelContext.build(tensor=tp, pipeline=pp)
    model = build_model(config, parallel, pctx, seed=SEED)
    padded = parallel.padded_vocab_size(config.vocab_size)
    names = [n for n, _ in model.named_parameters()]
    assert names, "every stage owns parameters"
    layout = ParamLayout(config)
    for name, param in model.named_parameters():
        spec = layout.for_module(name)
        assert param.tp_split == spec.split, f"{name}: the layer says {param.tp_split}, the layout {spec.split}"
        expected = shard_for_rank(spec, reference.__getitem__, config, pctx.tp_rank, tp, padded)
        assert torch.equal(param.detach(), expected), f"rank {rank} {name}"


@pytest.mark.launched
def test_tp4_pp2_init_is_sliced_tp1_init() -> None:
    run_distributed(_pipeline_worker, 8, 4, 2, True)
