"""Model/parallel config loading (HF config.json, v4 and v5 rope keys, presets) and every validation error."""

from __future__ import annotations

import glob
import json
import math
import os

import pytest
from transformers import LlamaConfig

from llama_megatron.config import ModelConfig
from llama_megatron.errors import ConfigError
from llama_megatron.parallel.degrees import LocalShapes, ParallelConfig, padded_vocab_size

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_hf_config_json_loads_as_is(tmp_path) -> None:
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}
    hf = LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, rope_theta=500000.0, rope_scaling=rope,
                     max_position_embeddings=131072, tie_word_embeddings=True)
    hf.save_pretrained(tmp_path)
    config = ModelConfig.from_file(str(tmp_path))
    assert config.rope_theta == 500000.0
    assert config.rope_type == "llama3" and config.rope_scaling["factor"] == 8.0
    assert (config.num_key_value_heads, config.head_dim, config.tie_word_embeddings) == (2, 16, True)


def test_released_v4_keys_and_v5_rope_parameters_agree() -> None:
    v4 = {"vocab_size": 10, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
          "num_attention_heads": 4, "rope_theta": 1e6, "rope_scaling": {"type": "linear", "factor": 4.0},
          "architectures": ["LlamaForCausalLM"], "torch_dtype": "bfloat16", "pretraining_tp": 1}
    v5 = {k: v for k, v in v4.items() if k not in ("rope_theta", "rope_scaling")}
    v5["rope_parameters"] = {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6}
    assert ModelConfig.from_dict(v4) == ModelConfig.from_dict(v5)
    plain = dict(v5, rope_parameters={"rope_type": "default", "rope_theta": 5e5})
    assert ModelConfig.from_dict(plain).rope_scaling is None and ModelConfig.from_dict(plain).rope_theta == 5e5


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "configs", "models", "*.json"))))
def test_presets_load(path: str) -> None:
    config = ModelConfig.from_file(path)
    expected_billions = {"llama2-7b": 6.74, "llama2-13b": 13.0, "llama2-70b": 69.0, "llama3-8b": 8.03,
                         "llama3.1-8b": 8.03, "llama3-70b": 70.6, "tinyllama-1.1b": 1.10,
                         "mistral-7b": 7.24, "qwen2.5-7b": 7.62, "qwen3-8b": 8.19, "mixtral-8x7b": 46.7,
                         "qwen3-30b-a3b": 30.5, "qwen2-57b-a14b": 57.4}
    # the published counts; the parameters active per token too, within 2%: the model cards round down (Qwen3-30B-A3B's
    # "3.3B" is 3.35B, embeddings and head included)
    active = {"mixtral-8x7b": 12.9, "qwen3-30b-a3b": 3.3, "qwen2-57b-a14b": 14.2}
    name = os.path.basename(path)[:-5]
    if name in expected_billions:
        assert abs(config.num_parameters() / 1e9 - expected_billions[name]) / expected_billions[name] < 0.01
    if name in active:
        assert abs(config.num_active_parameters() / 1e9 - active[name]) / active[name] < 0.02


def test_num_parameters_matches_hf() -> None:
    from model_utils import hf_model, tiny_config

    for overrides in ({}, {"tie_word_embeddings": True, "attention_bias": True, "mlp_bias": True},
                      {"model_type": "qwen2"}, {"model_type": "qwen3", "head_dim": 12, "attention_bias": True},
                      {"model_type": "mistral", "sliding_window": 8},
                      {"model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2}):
        config = tiny_config(num_key_value_heads=2, **overrides)
        model = hf_model(config)
        assert config.num_parameters() == sum(p.numel() for p in model.parameters())


def _model(**kw) -> ModelConfig:
    base = dict(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                num_attention_heads=8, num_key_value_heads=4)
    base.update(kw)
    return ModelConfig(**base)


@pytest.mark.parametrize(
    "parallel, world, message",
    [
        (ParallelConfig(tensor=3), None, "does not divide num_attention_heads 8"),
        (ParallelConfig(tensor=8), None, "does not divide num_key_value_heads 4"),
        (ParallelConfig(tensor=1, sequence_parallel=True), None, "sequence_parallel needs tensor parallel"),
        (ParallelConfig(tensor=2, pipeline=2), 6, "world size 6 is not divisible by tensor x pipeline = 2 x 2"),
        (ParallelConfig(pipeline=5), None, "pipeline degree 5 exceeds num_hidden_layers 4"),
        (ParallelConfig(tensor=0), None, "parallel.tensor must be a positive integer"),
    ],
)
def test_invalid_parallel_configs(parallel: ParallelConfig, world, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parallel.validate(_model())
        parallel.check_world_size(world)


def test_intermediate_size_must_divide() -> None:
    with pytest.raises(ConfigError, match="does not divide intermediate_size 98"):
        ParallelConfig(tensor=4).validate(_model(intermediate_size=98))


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(num_attention_heads=8, num_key_value_heads=3), "not a multiple of num_key_value_heads"),
        (dict(hidden_size=65), "hidden_size 65 is not divisible by num_attention_heads"),
        (dict(rope_scaling={"rope_type": "yarnish", "factor": 2}), "rope_scaling type 'yarnish' is not supported"),
        (dict(rope_scaling={"rope_type": "linear"}), "rope_scaling.factor must be a number"),
        (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "needs low_freq_factor"),
        (dict(hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
        (dict(vocab_size=0), "model.vocab_size must be a positive integer"),
    ],
)
def test_invalid_model_configs(kw: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _model(**kw)


def test_unknown_key_and_bad_json(tmp_path) -> None:
    with pytest.raises(ConfigError, match="unknown model config keys for the llama family: hiden_size"):
        ModelConfig.from_dict({"hiden_size": 3})
    bad = tmp_path / "bad.json"
    bad.write_text('{"vocab_size": 3,\n')
    with pytest.raises(ConfigError, match="is not valid JSON: line"):
        ModelConfig.from_file(str(bad))
    with pytest.raises(ConfigError, match="model config not found"):
        ModelConfig.from_file(str(tmp_path / "missing.json"))
    (tmp_path / "list.json").write_text(json.dumps([1]))
    with pytest.raises(ConfigError, match="must hold a JSON object"):
        ModelConfig.from_file(str(tmp_path / "list.json"))


def test_vocab_padding() -> None:
    assert padded_vocab_size(32000, 128, 1) == 32000
    assert padded_vocab_size(32000, 128, 3) == 32256
    assert padded_vocab_size(128256, 128, 8) == 129024
    assert ParallelConfig(tensor=4).padded_vocab_size(250) == 512



TRAINING_CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "pretrain", "*.json"))
                          + glob.glob(os.path.join(ROOT, "configs", "finetune", "*.json")))


@pytest.mark.parametrize("path", TRAINING_CONFIGS)
def test_shipped_training_configs_load(path: str, monkeypatch) -> None:
    """Every shipped training config parses, validates and yields a DeepSpeed config for its own layout."""
    from llama_megatron.training.config import TrainingConfig
    from llama_megatron.training.engine.deepspeed_config import build_deepspeed_config

    monkeypatch.chdir(ROOT)
    config = TrainingConfig.from_file(path)
    par = config.parallel
    world = par.tensor * par.pipeline * math.lcm(par.context, par.expert)  # EP splits the data axis
    ds = build_deepspeed_config(config, config.deepspeed_config, world, "cuda")
    assert ds["train_batch_size"] == config.batch.global_batch_size * par.context  # DeepSpeed's DP group: DP x CP


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "ds_configs", "*.json"))))
def test_shipped_deepspeed_configs_load(path: str) -> None:
    from llama_megatron.training.config import TrainingConfig
    from llama_megatron.training.engine.deepspeed_config import build_deepspeed_config

    config = TrainingConfig.from_dict({"model": {"vocab_size": 64, "hidden_size": 16, "intermediate_size": 32,
                                                 "num_hidden_layers": 2, "num_attention_heads": 2}})
    assert build_deepspeed_config(config, path, 1, "cuda")["train_micro_batch_size_per_gpu"] == 1


SHAPE = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4)


def test_the_family_is_read_from_the_hf_config() -> None:
    """model_type or architectures name the family; its keys are accepted, HF's defaults fill those left out, and
    its export names the family's class; another family's keys are refused."""
    qwen2 = ModelConfig.from_dict({**SHAPE, "architectures": ["Qwen2ForCausalLM"]})
    assert (qwen2.model_type, qwen2.qkv_bias, qwen2.o_bias, qwen2.qk_norm) == ("qwen2", True, False, False)
    assert (qwen2.sliding_window, qwen2.max_window_layers, qwen2.layer_windows()) == (4096, 28, [None] * 4)
    assert qwen2.to_hf_dict()["architectures"] == ["Qwen2ForCausalLM"]
    windowed = ModelConfig.from_dict({**SHAPE, "model_type": "qwen2", "use_sliding_window": True,
                                      "sliding_window": 8, "max_window_layers": 2})
    assert windowed.layer_windows() == [None, None, 8, 8]
    typed = ModelConfig.from_dict({**SHAPE, "model_type": "qwen3", "use_sliding_window": True, "sliding_window": 8,
                                   "layer_types": ["sliding_attention", "full_attention"] * 2})
    assert typed.layer_windows() == [8, None, 8, None] and typed.qk_norm and not typed.qkv_bias
    mistral = ModelConfig.from_dict({**SHAPE, "model_type": "mistral"})
    assert mistral.layer_windows() == [4096] * 4 and "attention_bias" not in mistral.to_hf_dict()
    assert ModelConfig.from_dict({**SHAPE, "model_type": "mistral", "sliding_window": None}).layer_windows() == [None] * 4
    llama = ModelConfig.from_dict(SHAPE)
    assert llama.model_type == "llama" and "sliding_window" not in llama.to_hf_dict()
    assert ModelConfig.from_dict(llama.to_hf_dict()) == llama
    assert ModelConfig.from_dict(windowed.to_hf_dict()) == windowed


@pytest.mark.parametrize("data, message", [
    ({"model_type": "gpt2"}, "model_type 'gpt2' is not supported"),
    ({"architectures": ["GPT2LMHeadModel"]}, "architectures \\['GPT2LMHeadModel'\\] name no supported family"),
    ({"model_type": "llama", "architectures": ["Qwen2ForCausalLM"]}, "name different families"),
    ({"sliding_window": 4096}, "unknown model config keys for the llama family: sliding_window"),
    ({"model_type": "qwen2", "attention_bias": True}, "unknown model config keys for the qwen2 family: attention_bias"),
    ({"model_type": "mistral", "sliding_window": 0}, "sliding_window must be a positive integer or null"),
    ({"model_type": "qwen3", "layer_types": ["full_attention"]}, "layer_types must list 4 entries"),
    ({"model_type": "llama4", "attention_chunk_size": 0}, "attention_chunk_size must be a positive integer or null, "
                                                          "got 0"),
    ({"model_type": "llama4", "attention_chunk_size": "8k"}, "attention_chunk_size must be a positive integer"),
    ({"model_type": "llama4", "attention_chunk_size": None, "layer_types": ["chunked_attention"] * 4},
     "layer_types names chunked_attention layers and attention_chunk_size is null"),
    ({"model_type": "llama4", "no_rope_layers": [1, 0]}, "no_rope_layers must list 4 entries"),
])
def test_family_keys_are_checked(data: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dict({**SHAPE, **data})
    with pytest.raises(ConfigError, match="model.sliding_window is not a key of the llama family"):
        ModelConfig(**SHAPE, sliding_window=8)


def test_local_shapes() -> None:
    """One rank's share, derived once: heads, KV heads (repeated for CP when they do not split), MLP rows and the
    padded vocabulary's rows; the model's layers are built from it (tests/test_parallel_layers.py checks shapes)."""
    model = _model(num_attention_heads=8, num_key_value_heads=2, intermediate_size=96, vocab_size=100)
    shapes = ParallelConfig(tensor=2, context=2, make_vocab_size_divisible_by=8).local_shapes(model)
    assert (shapes.heads, shapes.kv_heads, shapes.kv_repeats, shapes.intermediate) == (4, 1, 2, 48)
    assert (shapes.padded_vocab_size, shapes.vocab_rows) == (112, 56)
    with pytest.raises(ValueError, match="without the padded vocabulary"):
        _ = LocalShapes.of(model, 2).vocab_rows
