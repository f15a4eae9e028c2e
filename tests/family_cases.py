"""Every model family's test cases, in one table every parity test reads: ``parity``, tiny-config overrides (HF key
names) compared in one process and under TP with the family's transformers class (tests/test_model_parity.py for
the dense families, tests/test_model_moe.py for the mixtures of experts); ``runs``, the training JSON overrides of the
family's launched runs (tests/test_model_families.py: every layout against TP1-PP1, export, generate; None for
``llama``, whose runs are the rest of the suite's). A family of llama_megatron/families.py is tested once it has a
row here, and tests/test_model_parity.py fails while one lacks it."""

from __future__ import annotations

from dataclasses import dataclass, field

from model_utils import LLAMA3_ROPE

from llama_megatron.families import FAMILIES as MODEL_FAMILIES


@dataclass(frozen=True)
class FamilyCases:
    parity: dict[str, dict] = field(default_factory=dict)
    runs: list[str] | None = None


MIXTRAL = dict(model_type="mixtral", num_key_value_heads=4, num_local_experts=4, num_experts_per_tok=2,
               output_router_logits=True, router_aux_loss_coef=0.02)
QWEN_MOE = dict(num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=3, moe_intermediate_size=48,
                output_router_logits=True, router_aux_loss_coef=0.02)

DEEPSEEK_V3 = dict(model_type="deepseek_v3", num_key_value_heads=8, q_lora_rank=24, kv_lora_rank=16,
                   qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10, num_local_experts=8, num_experts_per_tok=3,
                   n_group=4, topk_group=2, moe_intermediate_size=20, n_shared_experts=2, first_k_dense_replace=1,
                   routed_scaling_factor=2.5, norm_topk_prob=True, rope_interleave=True)

FAMILIES = {
    "llama": FamilyCases(parity={
        "mha-untied": dict(),
        "gqa-untied-bias": dict(num_key_value_heads=4, attention_bias=True, mlp_bias=True),
        "gqa-tied-llama3-oddvocab": dict(num_key_value_heads=4, tie_word_embeddings=True, vocab_size=250,
                                         rope_scaling=LLAMA3_ROPE, rope_theta=500000.0),
        "mqa-like-linear-rope": dict(num_key_value_heads=4, num_attention_heads=16, head_dim=8,
                                     rope_scaling={"type": "linear", "factor": 2.0}),
    }),
    "qwen2": FamilyCases(parity={
        "qwen2-windows-from-layer-1": dict(model_type="qwen2", hidden_size=96, num_key_value_heads=4,
                                           use_sliding_window=True, sliding_window=6, max_window_layers=1),
        "qwen2-layer-types": dict(model_type="qwen2", num_key_value_heads=4, use_sliding_window=True,
                                  sliding_window=5, layer_types=["sliding_attention", "full_attention"],
                                  rope_theta=1e6),
        # YaRN (Qwen2.5's long context): interpolated frequencies, cos and sin scaled by its attention factor
        "qwen2-yarn": dict(model_type="qwen2", num_key_value_heads=4,
                           rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}),
    }, runs=["model.model_type=qwen2", "model.use_sliding_window=true", "model.sliding_window=12",
             "model.max_window_layers=2"]),
    "qwen3": FamilyCases(parity={
        "qwen3-head-dim-12": dict(model_type="qwen3", num_key_value_heads=4, head_dim=12),
        "qwen3-bias-tied": dict(model_type="qwen3", num_key_value_heads=4, head_dim=12, attention_bias=True,
                                tie_word_embeddings=True),
    }, runs=["model.model_type=qwen3", "model.head_dim=24", "model.attention_bias=true",
             "model.use_sliding_window=true", "model.sliding_window=6",
             'model.layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"]']),
    "mistral": FamilyCases(parity={
        "mistral-window-5": dict(model_type="mistral", hidden_size=80, num_key_value_heads=4, sliding_window=5),
    }, runs=["model.model_type=mistral", "model.sliding_window=8"]),
    "mixtral": FamilyCases(parity={
        "top2-of-4-window": {**MIXTRAL, "sliding_window": 6},
        "top3-of-8-tied": {**MIXTRAL, "num_local_experts": 8, "num_experts_per_tok": 3, "tie_word_embeddings": True,
                           "hidden_size": 96, "intermediate_size": 48},
        "no-aux-loss": {**MIXTRAL, "output_router_logits": False},
    }, runs=["model.model_type=mixtral", "model.sliding_window=8", "model.num_local_experts=4",
             "model.num_experts_per_tok=2", "model.output_router_logits=true", "model.router_aux_loss_coef=0.02"]),
    # Qwen3-MoE: q/k norms, experts narrower than the dense layer 1 (mlp_only_layers), weights renormalised; its runs
    # with HF's key names (num_experts), a dense layer (mlp_only_layers) on the first pipeline stage
    "qwen3_moe": FamilyCases(parity={
        "qwen3-moe": {**QWEN_MOE, "model_type": "qwen3_moe", "norm_topk_prob": True, "mlp_only_layers": [1]},
    }, runs=["model.model_type=qwen3_moe", "model.use_sliding_window=true", "model.sliding_window=8",
             "model.num_experts=4", "model.num_experts_per_tok=2", "model.moe_intermediate_size=48",
             "model.norm_topk_prob=true", "model.mlp_only_layers=[1]", "model.output_router_logits=true",
             "model.router_aux_loss_coef=0.02"]),
    # Qwen2-MoE: q/k/v biases, a shared expert beside the routed ones, weights not renormalised, a window (layer 0);
    # its runs: the shared expert, MoE on every other layer, windows on layers 0 and 2
    "qwen2_moe": FamilyCases(parity={
        "qwen2-moe": {**QWEN_MOE, "model_type": "qwen2_moe", "attention_bias": True,
                      "shared_expert_intermediate_size": 80, "use_sliding_window": True, "sliding_window": 6,
                      "max_window_layers": 2},
    }, runs=["model.model_type=qwen2_moe", "model.use_sliding_window=true", "model.sliding_window=12",
             "model.max_window_layers=4", "model.num_experts=4", "model.num_experts_per_tok=2",
             "model.moe_intermediate_size=48", "model.shared_expert_intermediate_size=96",
             "model.decoder_sparse_step=2", "model.output_router_logits=true", "model.router_aux_loss_coef=0.02"]),
    # Llama 4: chunked attention (chunks of 5 in sequences of 16, across CP shards) on the RoPE layers, NoPE layers
    # with full attention and the temperature (floor_scale 3: it changes every 3 positions), q/k L2 norm, interleaved
    # RoPE pairs with llama3 scaling, top-1 sigmoid routing of 8 experts scaling the inputs, the shared expert, MoE on
    # every other layer and dense layers of their own width; then every third layer NoPE, top-2, biases, tied
    "llama4": FamilyCases(parity={
        "llama4-chunked-nope-moe": dict(model_type="llama4", num_hidden_layers=4, num_key_value_heads=4,
                                        attention_chunk_size=5, no_rope_layer_interval=2, interleave_moe_layer_step=2,
                                        num_local_experts=8, num_experts_per_tok=1, intermediate_size_mlp=80,
                                        use_qk_norm=True, attn_temperature_tuning=True, floor_scale=3,
                                        rope_scaling=LLAMA3_ROPE),
        "llama4-top2-bias-tied": dict(model_type="llama4", num_hidden_layers=3, num_key_value_heads=4,
                                      attention_chunk_size=4, no_rope_layer_interval=3, num_local_experts=4,
                                      num_experts_per_tok=2, intermediate_size_mlp=48,
                                      attn_temperature_tuning=True, floor_scale=2, attn_scale=0.5,
                                      attention_bias=True, tie_word_embeddings=True),
    # its runs: chunks of 8 in samples of 32, layers 0 and 2 RoPE (chunked, q/k norm), 1 and 3 NoPE (full, the
    # temperature changing every 8 positions), MoE (4 experts, top 1) on layers 1 and 3, dense layers of 96
    }, runs=["model.model_type=llama4", "model.attention_chunk_size=8", "model.no_rope_layer_interval=2",
             "model.interleave_moe_layer_step=2", "model.num_local_experts=4", "model.num_experts_per_tok=1",
             "model.intermediate_size_mlp=96", "model.floor_scale=8"]),
    # DeepSeek-V3: MLA (q latent 24, kv latent 16, heads of 12 + 8 for q.k and 10 for v; RoPE pairs interleaved in
    # the released rows), a dense first layer, then 8 routed experts in 4 groups (the best 2 groups' top 3, chosen
    # with the correction bias, weights renormalised and scaled by 2.5) beside 2 shared experts; and without a q
    # latent, with YaRN (its mscale on the softmax scale), biases, the weights unnormalised and rotate-half rows
    # its runs: layer 0 dense, MoE from layer 1 on (8 experts in 4 groups, top 2 of the best 2 groups, a shared
    # expert), MLA with a q latent, interleaved RoPE rows in the converted files (KV heads = heads: transformers'
    # DeepseekV3Attention repeats its per-head keys by their ratio)
    "deepseek_v3": FamilyCases(parity={
        "deepseek-v3": DEEPSEEK_V3,
        "deepseek-v3-plain-q-yarn": {**DEEPSEEK_V3, "q_lora_rank": None, "norm_topk_prob": False,
                                     "rope_interleave": False, "attention_bias": True, "first_k_dense_replace": 0,
                                     "rope_scaling": {"type": "yarn", "factor": 4.0,
                                                      "original_max_position_embeddings": 16, "mscale": 1.0,
                                                      "mscale_all_dim": 1.0}},
    }, runs=["model.model_type=deepseek_v3", "model.num_key_value_heads=4", "model.q_lora_rank=24", "model.kv_lora_rank=16",
             "model.qk_nope_head_dim=12", "model.qk_rope_head_dim=8", "model.v_head_dim=10",
             "model.num_local_experts=8", "model.num_experts_per_tok=2", "model.n_group=4", "model.topk_group=2",
             "model.moe_intermediate_size=32", "model.n_shared_experts=1", "model.first_k_dense_replace=1",
             "model.routed_scaling_factor=2.5", "model.rope_interleave=true"]),
}


def _moe(family: str) -> bool:
    return MODEL_FAMILIES[family].moe is not None


DENSE_PARITY = {name: case for family, cases in FAMILIES.items() if not _moe(family)
                for name, case in cases.parity.items()}
MOE_PARITY = {name: case for family, cases in FAMILIES.items() if _moe(family) for name, case in cases.parity.items()}
RUNS = {family: cases.runs for family, cases in FAMILIES.items() if cases.runs is not None}
MOE_FAMILIES = tuple(family for family in RUNS if _moe(family))
