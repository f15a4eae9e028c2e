"""Whole training runs of each model family under the deepspeed launcher (llama_megatron/families.py).

A seeded random model of each family (Qwen2 with q/k/v biases and sliding windows from layer 2 on, Qwen3 with q/k
norms, head_dim 24 != 64 / 4, biases and windows on alternate layers, Mistral with an 8-token window on every layer;
sequences of 32 tokens, so every window is shorter than a sample):

- the one-process TP1-PP1 run, replayed step by step with the family's transformers class and torch AdamW on the
  same batches (1e-4 rel per step, grad norms 1e-3);
- TP2 x PP2 with sequence parallelism and recomputation, and CP2 x PP2, against TP1-PP1 (1e-4 rel per step).
"""

from __future__ import annotations

import os

import pytest
from launch_utils import ROOT, assert_losses_close, assert_run_replays_hf, launch_many, losses, train_args
from model_utils import hf_class

from llama_megatron.training.config import TrainingConfig

CONFIG = os.path.join(ROOT, "tests", "configs", "e2e_pretrain.json")
STEPS = 6
FAMILIES = {
    "qwen2": ["model.model_type=qwen2", "model.use_sliding_window=true", "model.sliding_window=12",
              "model.max_window_layers=2"],
    "qwen3": ["model.model_type=qwen3", "model.head_dim=24", "model.attention_bias=true",
              "model.use_sliding_window=true", "model.sliding_window=6",
              'model.layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"]'],
    "mistral": ["model.model_type=mistral", "model.sliding_window=8"],
}
LAYOUTS = {
    "tp2-pp2-sp-recompute": ["parallel.tensor=2", "parallel.pipeline=2", "parallel.sequence_parallel=true",
                             "activation_checkpointing.interval=1"],
    "cp2-pp2": ["parallel.context=2", "parallel.pipeline=2"],
}


def _overrides(prefix: str, out, family: str, layout: list[str]) -> list[str]:
    return [f"data.prefix={prefix}", f"output_dir={out}", f"train.steps={STEPS}", *FAMILIES[family], *layout]


@pytest.fixture(scope="module")
def runs(shakespeare_prefix, tmp_path_factory):
    work = tmp_path_factory.mktemp("families")
    launch_many(1, [train_args(CONFIG, _overrides(shakespeare_prefix, work / f"{family}-tp1-pp1", family, []))
                    for family in FAMILIES], str(work / "runs-1.json"))
    launch_many(4, [train_args(CONFIG, _overrides(shakespeare_prefix, work / f"{family}-{name}", family, layout))
                    for family in FAMILIES for name, layout in LAYOUTS.items()], str(work / "runs-4.json"))
    return work


@pytest.mark.parametrize("family", list(FAMILIES))
def test_tp1_pp1_trains_like_the_transformers_class(runs, family, shakespeare_prefix) -> None:
    config = TrainingConfig.from_file(CONFIG, _overrides(shakespeare_prefix, runs / "hf", family, []))
    assert config.model.model_type == family and any(w is not None for w in config.model.layer_windows())
    assert hf_class(config.model).__name__ == config.model.family.architecture
    assert_run_replays_hf(runs / f"{family}-tp1-pp1", config)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_layouts_train_like_tp1_pp1(runs, family, layout) -> None:
    reference = losses(runs / f"{family}-tp1-pp1")
    assert_losses_close(losses(runs / f"{family}-{layout}"), reference, 1e-4, range(1, STEPS + 1))
