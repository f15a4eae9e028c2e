"""DeepSeek-V3's own checks, in this process: its config as transformers writes it reads back and writes the same
keys; what cannot run is one line; the routing biases move by the report's rule from the loads of a training step's
forwards (and of no other). Its parity with transformers under every layout: tests/test_model_moe.py (its cases are
tests/family_cases.py's); its runs: tests/test_model_families.py."""

from __future__ import annotations

import pytest
import torch
from family_cases import DEEPSEEK_V3
from model_utils import tiny_config

from llama_megatron.config import ModelConfig
from llama_megatron.errors import ConfigError
from llama_megatron.model.build import build_model
from llama_megatron.model.lora_layout import LoraConfig, check_targets
from llama_megatron.model.moe import MoEMLP
from llama_megatron.model.routing import update_routing_biases
from llama_megatron.parallel.context import ParallelContext
from llama_megatron.parallel.degrees import ParallelConfig


def test_transformers_config_reads_and_writes_back() -> None:
    from transformers import DeepseekV3Config

    hf = DeepseekV3Config(vocab_size=100, hidden_size=64, intermediate_size=96, moe_intermediate_size=20,
                          num_hidden_layers=3, num_attention_heads=4, n_routed_experts=8, n_group=4, topk_group=2,
                          num_experts_per_tok=2, q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=8,
                          qk_rope_head_dim=4, v_head_dim=6, first_k_dense_replace=1)
    config = ModelConfig.from_dict(hf.to_dict())
    assert (config.model_type, config.num_local_experts, config.head_dim, config.qk_head_dim) == ("deepseek_v3", 8, 4, 12)
    assert [config.is_moe_layer(i) for i in range(3)] == [False, True, True]
    back = DeepseekV3Config(**config.to_hf_dict()).to_dict()
    assert {k: v for k, v in hf.to_dict().items() if k != "architectures"} == {
        k: v for k, v in back.items() if k in hf.to_dict() and k != "architectures"}
    assert config.kv_cache_widths(2) == (1, 8 + 4, 0)  # the latent and the shared rotated key, whole on a TP rank


@pytest.mark.parametrize("bad, message", [
    ({"topk_method": "greedy"}, "model.topk_method 'greedy' with scoring_func 'sigmoid' is not supported"),
    ({"scoring_func": "softmax"}, "scoring_func 'softmax' is not supported"),
    ({"n_group": 3}, "model.n_routed_experts 8 is not divisible by n_group 3"),
    ({"topk_group": 5}, "model.topk_group 5 exceeds n_group 4"),
    ({"n_group": 8, "topk_group": 2}, "groups of one expert"),
    ({"num_experts_per_tok": 5}, "model.num_experts_per_tok 5 exceeds the experts of topk_group 2 groups"),
    ({"output_router_logits": True}, "model.output_router_logits: DeepSeek-V3 balances its experts"),
    ({"q_lora_rank": 0}, "model.q_lora_rank must be a positive integer or null"),
    ({"head_dim": 12}, "model.head_dim 12 must be qk_rope_head_dim 8"),
    ({"routed_scaling_factor": 0}, "model.routed_scaling_factor must be > 0"),
])
def test_what_cannot_run_is_one_line(bad: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as caught:
        tiny_config(**{**DEEPSEEK_V3, **bad})
    assert "\n" not in str(caught.value)


def test_lora_on_the_latent_attention_is_refused_and_on_its_experts_taken() -> None:
    config = tiny_config(**DEEPSEEK_V3)
    with pytest.raises(ConfigError, match="lora.targets q_proj, o_proj: .* multi-head latent attention"):
        check_targets(config, LoraConfig(rank=2, targets=("q_proj", "o_proj", "down_proj")))
    check_targets(config, LoraConfig(rank=2, targets=("gate_proj", "down_proj", "mlp.experts.down_proj")))


def test_routing_biases_move_by_the_sign_of_each_experts_load_against_the_mean() -> None:
    """Two training micro batches (forwards with gradients) count every token's k assignments per layer; an
    evaluation forward and one without gradients count none; the update moves each bias by rate x sign(mean - load)
    and clears the counts."""
    config = tiny_config(**DEEPSEEK_V3)
    model = build_model(config, ParallelConfig(make_vocab_size_divisible_by=8), ParallelContext.single(), seed=3)
    layers = [m for m in model.modules() if isinstance(m, MoEMLP)]
    assert len(layers) == config.num_hidden_layers - config.first_k_dense_replace
    ids = torch.randint(0, config.vocab_size, (2, 2, 17), generator=torch.Generator().manual_seed(0))
    model.train()
    for mb in ids:
        model(mb[:, :-1], labels=mb[:, 1:]).backward()
    with torch.no_grad():
        model(ids[0, :, :-1], labels=ids[0, :, 1:])
    model.eval()
    model(ids[0, :, :-1], labels=ids[0, :, 1:])
    counts = [layer.step_counts.clone() for layer in layers]
    assert all(int(c.sum()) == 2 * 2 * 16 * config.num_experts_per_tok for c in counts)
    before = [layer.router.e_score_correction_bias.clone() for layer in layers]
    assert update_routing_biases(model, ParallelContext.single(), 1e-3) == len(layers)
    for layer, c, old in zip(layers, counts, before):
        load = c.double()
        want = old + (1e-3 * torch.sign(load.mean() - load)).float()
        assert torch.equal(layer.router.e_score_correction_bias, want)
        assert not layer.step_counts.any()
        assert not layer.router.e_score_correction_bias.requires_grad


def test_a_training_config_refuses_fp8_on_the_latent_attention() -> None:
    from family_cases import RUNS
    from launch_utils import PRETRAIN_CONFIG

    from llama_megatron.training.config import TrainingConfig

    base = ['data={"type": "synthetic"}', *RUNS["deepseek_v3"]]
    TrainingConfig.from_file(PRETRAIN_CONFIG, base)  # (the family's runs' config is whole)
    with pytest.raises(ConfigError, match="fp8: the deepseek_v3 model's multi-head latent attention does not train"):
        TrainingConfig.from_file(PRETRAIN_CONFIG, [*base, 'fp8={"recipe": "tensorwise"}'])
