"""Model families: the LLaMA-architecture decoders this package trains, one description each.

Every family is the LLaMA decoder (RMSNorm, RoPE, SwiGLU, GQA) with small additions; a :class:`ModelFamily` names
them once, and every reader asks it rather than keeping its own list:

- which Hugging Face config (``model_type``, ``architectures``) it is, and the architecture written on export;
- the config keys it accepts beyond the shared decoder's (``ModelConfig`` refuses the others);
- the parameters it adds (biases on q/k/v and o, per-head q/k RMSNorm weights), which
  :mod:`llama_megatron.model.param_layout` turns into rows of the one parameter table;
- its attention options: the sliding window of each layer (None: full causal attention);
- a mixture of experts' shape and names (:class:`MoEFamily`): which layers route, the experts' width, whether a
  shared expert runs beside them, how the routing weights are formed, the checkpoint's tensor names;
- the config keys its HF config class names differently (Qwen's ``num_experts``), renamed on load and export.

=========  ===========================================================================================
llama      q/k/v/o biases and MLP biases when ``attention_bias`` / ``mlp_bias`` (LLaMA 1-3.x, Yi, ...)
mistral    sliding-window attention on every layer (``sliding_window``, None for full attention)
qwen2      q/k/v biases (never o); sliding windows on the layers ``layer_types`` names (or from
           ``max_window_layers`` on) when ``use_sliding_window``
qwen3      per-head RMSNorm on q and k before RoPE; q/k/v/o biases when ``attention_bias``; windows as qwen2
mixtral    Mistral's attention; the MLP replaced by a router and ``num_local_experts`` SwiGLU experts, of which
           each token uses ``num_experts_per_tok`` (:mod:`llama_megatron.model.moe`)
qwen3_moe  Qwen3's attention (q/k norms, no window layers: ``sliding_window`` on every layer when
           ``use_sliding_window``); MoE on the layers ``decoder_sparse_step`` / ``mlp_only_layers`` name (a dense
           MLP of ``intermediate_size`` on the others), experts of ``moe_intermediate_size``, the k weights
           renormalised only when ``norm_topk_prob``; HF's ``num_experts`` is our ``num_local_experts``
qwen2_moe  Qwen2's q/k/v biases (HF's ``qkv_bias``, our ``attention_bias``), MoE layers and experts as qwen3_moe, and
           beside the routed experts a shared SwiGLU expert of ``shared_expert_intermediate_size`` scaled by
           ``sigmoid(x W_gate)``; windows on the even layers below ``max_window_layers`` (or as ``layer_types``)
llama4     Llama 4's text model (HF ``llama4_text``, ``Llama4ForCausalLM``): ``layer_types`` of chunked attention
           (``attention_chunk_size``) and full attention; RoPE on the layers ``no_rope_layers`` marks 1 (pairs
           interleaved in the released weights: conversion permutes q and k rows to rotate-half, see
           :mod:`llama_megatron.model.released_tensors`), a weightless L2 norm of q and k after it
           (``use_qk_norm``), and on the other (NoPE) layers the queries scaled by ``attn_temperature_tuning``'s
           rule of the position; MoE on ``moe_layers`` (every ``interleave_moe_layer_step``-th layer): top-k of the
           router logits, the sigmoid of the chosen logit scaling the expert's input, an ungated shared expert, all
           of ``intermediate_size``; dense layers of ``intermediate_size_mlp``; the MLP is ``feed_forward``
deepseek_v3 multi-head latent attention (:mod:`llama_megatron.model.latent_attention`): q through a ``q_lora_rank``
           latent (or one projection), k and v expanded from a ``kv_lora_rank`` latent per token, a
           ``qk_rope_head_dim`` key part every head shares (RoPE pairs interleaved in the released weights when
           ``rope_interleave``), heads of ``qk_nope_head_dim + qk_rope_head_dim`` for q.k and ``v_head_dim`` for v,
           YaRN's mscale on the softmax scale; dense MLPs on the first ``first_k_dense_replace`` layers, MoE after:
           sigmoid scores, ``e_score_correction_bias`` added for the choice only, the best ``topk_group`` of
           ``n_group`` groups (by their two best biased scores), the k weights renormalised (``norm_topk_prob``)
           and scaled by ``routed_scaling_factor``, ``n_shared_experts`` ungated shared experts of
           ``moe_intermediate_size`` each (one SwiGLU of their joint width); HF's ``n_routed_experts``
=========  ===========================================================================================
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

FULL_ATTENTION, SLIDING_ATTENTION, CHUNKED_ATTENTION = "full_attention", "sliding_attention", "chunked_attention"


@dataclass(frozen=True)
class MoEFamily:
    """How a family's mixture of experts differs from Mixtral's (the defaults)."""

    # the MoE block's module in released checkpoints, and one expert's gate, up and down projections under it
    block: str = "block_sparse_moe"
    leaves: tuple[str, str, str] = ("w1", "w3", "w2")
    width_key: str = "intermediate_size"  # config key of one routed expert's FFN width
    # (config, layer) -> whether the layer's MLP is the MoE block (else a dense SwiGLU of intermediate_size)
    routed: Callable[[Any, int], bool] = lambda config, layer: True
    # Qwen2-MoE: a SwiGLU of shared_expert_intermediate_size on every token, scaled by sigmoid(x W), added
    shared_expert: bool = False
    norm_topk: Callable[[Any], bool] = lambda config: True  # the k routing weights renormalised to sum to 1
    # HF's Qwen router casts the (fp32) routing weights to the model's dtype before they scale the experts'
    # outputs; Mixtral's scales in fp32 and casts the product (the same in fp32, not in bf16)
    weights_in_model_dtype: bool = False
    # LoRA's MLP targets (gate_proj, up_proj, down_proj) as PEFT finds them on the class, by module name: the shared
    # expert's and the dense layers' linears (Qwen2-MoE). Off: none (Mixtral's are w1/w3/w2; on Qwen3-MoE PEFT 0.21
    # maps those names onto the experts' parameters, transformers v4's layout, and leaves dense layers unadapted)
    mlp_module_targets: bool = False
    router: str = "gate"  # the router's module under ``block``
    # "softmax": weights from the softmax of the logits (top-k, renormalised per norm_topk), scaling the experts'
    # outputs (Mixtral, Qwen); "sigmoid_input": top-k of the logits, the sigmoid of each chosen logit scaling the
    # token on its way into the expert (Llama 4); "sigmoid_group": DeepSeek-V3's group-limited choice over sigmoid
    # scores plus the correction bias, the chosen scores (renormalised per norm_topk) times routed_scaling_factor
    # scaling the experts' outputs
    routing: str = "softmax"
    # the router's e_score_correction_bias (DeepSeek-V3): added to the scores for the choice only, moved after each
    # step by the experts' loads (auxiliary-loss-free balancing), not by a gradient
    router_bias: bool = False
    shared_expert_gated: bool = True  # Qwen2-MoE's sigmoid(x W_gate) on the shared expert (Llama 4: none)
    shared_width_key: str = "shared_expert_intermediate_size"
    # the config key counting shared experts of shared_width_key's width each, run as one SwiGLU of their joint
    # width (DeepSeek's n_shared_experts; None: one)
    shared_count_key: str | None = None
    shared_name: str = "shared_expert"  # the shared expert's module under ``block`` in released checkpoints
    # the released files hold each layer's experts as two 3-D tensors, experts.gate_up_proj [E, h, 2 x ffn] and
    # experts.down_proj [E, ffn, h] (Llama 4); the table names one expert's linears (model/released_tensors.py)
    fused_expert_files: bool = False


@dataclass(frozen=True)
class ModelFamily:
    model_type: str  # HF config's model_type, also ours
    architecture: str  # the HF class a checkpoint of this family loads as (written on export)
    keys: tuple[str, ...]  # config keys of this family beyond the shared decoder's (``mlp_bias`` among them or not)
    defaults: dict[str, Any]  # HF's values for those keys when a config.json leaves them out
    qkv_bias: Callable[[Any], bool]  # config -> biases on q, k and v
    o_bias: Callable[[Any], bool]
    qk_norm: bool  # RMSNorm over head_dim on every query and key head, before RoPE
    window: Callable[[Any, int], int | None]  # (config, layer) -> sliding window in tokens, or None
    moe: MoEFamily | None = None  # a mixture of experts (the family's keys say how many experts)
    hf_keys: dict[str, str] = field(default_factory=dict)  # our config key -> the HF config class's name for it
    hf_model_type: str | None = None  # the HF config's model_type where it is not ours (Llama 4's llama4_text)
    # (config, layer) -> attention in chunks of this many tokens (a query sees the keys of its own chunk up to
    # itself), or None
    chunk: Callable[[Any, int], int | None] = lambda config, layer: None
    rope: Callable[[Any, int], bool] = lambda config, layer: True  # False: no position embedding (NoPE)
    l2_qk_norm: Callable[[Any, int], bool] = lambda config, layer: False  # weightless RMS norm of q, k after RoPE
    # (config, layer) -> queries scaled by 1 + attn_scale x log1p(floor((position + 1) / floor_scale))
    temperature: Callable[[Any, int], bool] = lambda config, layer: False
    # config -> the released q/k rows rotate interleaved pairs (converted to rotate-half)
    interleaved_rope: Callable[[Any], bool] = lambda config: False
    # multi-head latent attention (DeepSeek-V3) in place of grouped-query attention: its own module, parameter rows,
    # FLOPs, activation bytes and KV cache
    latent_attention: bool = False
    mlp_name: str = "mlp"  # the MLP's module in released checkpoints (a dense layer's, and the MoE block's parent)
    dense_width_key: str = "intermediate_size"  # config key of a dense layer's FFN width
    # the prefix of the text model's tensors in a released multimodal checkpoint (its other tensors left out)
    multimodal_prefix: str | None = None

    def windows(self, config: Any) -> list[int | None]:
        return [self.window(config, i) for i in range(config.num_hidden_layers)]

    @property
    def hf_type(self) -> str:
        return self.hf_model_type or self.model_type


def _no_window(config: Any, layer: int) -> int | None:
    return None


def _qwen_window(config: Any, layer: int) -> int | None:
    """HF's Qwen2/Qwen3: ``sliding_window`` counts only with ``use_sliding_window``; ``layer_types`` names the
    windowed layers, and without it the layers from ``max_window_layers`` on are."""
    window = config.sliding_window if config.use_sliding_window else None
    if window is None:
        return None
    if config.layer_types is not None:
        return window if config.layer_types[layer] == SLIDING_ATTENTION else None
    return window if layer >= config.max_window_layers else None


def _attention_bias(config: Any) -> bool:
    return bool(config.attention_bias)


def _never(config: Any) -> bool:
    return False


def _qwen2_moe_window(config: Any, layer: int) -> int | None:
    """HF's Qwen2-MoE: ``layer_types`` names the windowed layers, and without it every other layer (0, 2, ...) below
    ``max_window_layers`` is, all only with ``use_sliding_window``."""
    if not config.use_sliding_window:
        return None
    if config.layer_types is not None:
        return config.sliding_window if config.layer_types[layer] == SLIDING_ATTENTION else None
    return config.sliding_window if layer % 2 == 0 and layer < config.max_window_layers else None


def _qwen_routed(config: Any, layer: int) -> bool:
    """HF's Qwen MoE decoder layer: the MoE block unless ``mlp_only_layers`` lists the layer or it is not one of
    every ``decoder_sparse_step``."""
    return layer not in (config.mlp_only_layers or ()) and (layer + 1) % config.decoder_sparse_step == 0


MOE_KEYS = ("num_local_experts", "num_experts_per_tok", "router_aux_loss_coef", "output_router_logits")
MOE_DEFAULTS = {"num_local_experts": 8, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.001,
                "output_router_logits": False}
QWEN_MOE_KEYS = (*MOE_KEYS, "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers")
QWEN_MOE = MoEFamily(block="mlp", leaves=("gate_proj", "up_proj", "down_proj"), width_key="moe_intermediate_size",
                     routed=_qwen_routed, norm_topk=lambda config: config.norm_topk_prob,
                     weights_in_model_dtype=True)
QWEN_WINDOW_KEYS = ("use_sliding_window", "sliding_window", "max_window_layers", "layer_types")
QWEN_WINDOW_DEFAULTS = {"use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28}

def _llama4_rope(config: Any, layer: int) -> bool:
    return bool(config.no_rope_layers[layer])


LLAMA4_KEYS = ("attention_bias", "attention_chunk_size", "no_rope_layers", "no_rope_layer_interval", "use_qk_norm",
               "attn_temperature_tuning", "floor_scale", "attn_scale", "intermediate_size_mlp", "moe_layers",
               "interleave_moe_layer_step", "layer_types", *MOE_KEYS, "router_jitter_noise")
LLAMA4_DEFAULTS = {"attention_chunk_size": 8192, "no_rope_layer_interval": 4, "use_qk_norm": True,
                   "attn_temperature_tuning": True, "floor_scale": 8192, "attn_scale": 0.1,
                   "intermediate_size_mlp": 16384, "interleave_moe_layer_step": 1, "num_local_experts": 16,
                   "num_experts_per_tok": 1, "router_aux_loss_coef": 0.001, "output_router_logits": False,
                   "router_jitter_noise": 0.0, "rope_theta": 500000.0}
LLAMA4_MOE = MoEFamily(block="feed_forward", leaves=("gate_proj", "up_proj", "down_proj"), routed=lambda c, i:
                       i in c.moe_layers, norm_topk=lambda config: False, router="router", routing="sigmoid_input",
                       shared_expert=True, shared_expert_gated=False, shared_width_key="intermediate_size",
                       fused_expert_files=True, mlp_module_targets=True)

DEEPSEEK_V3_KEYS = ("attention_bias", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                    "v_head_dim", *MOE_KEYS, "moe_intermediate_size", "n_shared_experts", "n_group", "topk_group",
                    "routed_scaling_factor", "norm_topk_prob", "first_k_dense_replace", "rope_interleave",
                    "num_nextn_predict_layers", "topk_method", "scoring_func")
# transformers' DeepseekV3Config defaults (DeepSeek-V3's sizes), but for multi-token prediction: a config.json that
# does not name its MTP layers has none (transformers builds none either; it drops them on load)
DEEPSEEK_V3_DEFAULTS = {"q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                        "v_head_dim": 128, "num_local_experts": 256, "num_experts_per_tok": 8,
                        "router_aux_loss_coef": 0.001, "output_router_logits": False, "moe_intermediate_size": 2048,
                        "n_shared_experts": 1, "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5,
                        "norm_topk_prob": True, "first_k_dense_replace": 3, "rope_interleave": True,
                        "num_nextn_predict_layers": 0, "topk_method": "noaux_tc", "scoring_func": "sigmoid"}
DEEPSEEK_V3_MOE = MoEFamily(block="mlp", leaves=("gate_proj", "up_proj", "down_proj"),
                            width_key="moe_intermediate_size",
                            routed=lambda config, layer: layer >= config.first_k_dense_replace,
                            norm_topk=lambda config: config.norm_topk_prob, routing="sigmoid_group", router_bias=True,
                            shared_expert=True, shared_expert_gated=False, shared_width_key="moe_intermediate_size",
                            shared_count_key="n_shared_experts", shared_name="shared_experts",
                            mlp_module_targets=True)

FAMILIES: dict[str, ModelFamily] = {f.model_type: f for f in (
    ModelFamily("llama", "LlamaForCausalLM", ("attention_bias", "mlp_bias"), {}, _attention_bias, _attention_bias,
                qk_norm=False, window=_no_window),
    ModelFamily("mistral", "MistralForCausalLM", ("sliding_window",), {"sliding_window": 4096}, _never, _never,
                qk_norm=False, window=lambda c, i: c.sliding_window),
    ModelFamily("qwen2", "Qwen2ForCausalLM", QWEN_WINDOW_KEYS, QWEN_WINDOW_DEFAULTS, lambda c: True, _never,
                qk_norm=False, window=_qwen_window),
    ModelFamily("qwen3", "Qwen3ForCausalLM", ("attention_bias", *QWEN_WINDOW_KEYS), QWEN_WINDOW_DEFAULTS,
                _attention_bias, _attention_bias, qk_norm=True, window=_qwen_window),
    ModelFamily("mixtral", "MixtralForCausalLM", ("sliding_window", *MOE_KEYS, "router_jitter_noise"),
                {"sliding_window": None, **MOE_DEFAULTS, "router_jitter_noise": 0.0},
                _never, _never, qk_norm=False, window=lambda c, i: c.sliding_window, moe=MoEFamily()),
    # max_window_layers: in the released config.json files, unread by HF's Qwen3-MoE (every layer is windowed)
    ModelFamily("qwen3_moe", "Qwen3MoeForCausalLM",
                ("attention_bias", "use_sliding_window", "sliding_window", "max_window_layers", *QWEN_MOE_KEYS),
                {"use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28, "num_local_experts": 128,
                 "num_experts_per_tok": 8, "router_aux_loss_coef": 0.001, "output_router_logits": False,
                 "moe_intermediate_size": 768, "norm_topk_prob": False, "decoder_sparse_step": 1,
                 "mlp_only_layers": []},
                _attention_bias, _attention_bias, qk_norm=True,
                window=lambda c, i: c.sliding_window if c.use_sliding_window else None, moe=QWEN_MOE,
                hf_keys={"num_local_experts": "num_experts"}),
    ModelFamily("qwen2_moe", "Qwen2MoeForCausalLM",
                ("attention_bias", *QWEN_WINDOW_KEYS, *QWEN_MOE_KEYS, "shared_expert_intermediate_size"),
                {**QWEN_WINDOW_DEFAULTS, "attention_bias": True, "num_local_experts": 60, "num_experts_per_tok": 4,
                 "router_aux_loss_coef": 0.001, "output_router_logits": False, "moe_intermediate_size": 1408,
                 "shared_expert_intermediate_size": 5632, "norm_topk_prob": False, "decoder_sparse_step": 1,
                 "mlp_only_layers": []},
                _attention_bias, _never, qk_norm=False, window=_qwen2_moe_window,
                moe=dataclasses.replace(QWEN_MOE, shared_expert=True, mlp_module_targets=True),
                hf_keys={"num_local_experts": "num_experts", "attention_bias": "qkv_bias"}),
    ModelFamily("llama4", "Llama4ForCausalLM", LLAMA4_KEYS, LLAMA4_DEFAULTS, _attention_bias, _attention_bias,
                qk_norm=False, window=_no_window, moe=LLAMA4_MOE, hf_model_type="llama4_text",
                chunk=lambda c, i: c.attention_chunk_size if c.layer_types[i] == CHUNKED_ATTENTION else None,
                rope=_llama4_rope, l2_qk_norm=lambda c, i: c.use_qk_norm and _llama4_rope(c, i),
                temperature=lambda c, i: c.attn_temperature_tuning and not _llama4_rope(c, i),
                interleaved_rope=lambda config: True, mlp_name="feed_forward",
                dense_width_key="intermediate_size_mlp", multimodal_prefix="language_model."),
    ModelFamily("deepseek_v3", "DeepseekV3ForCausalLM", DEEPSEEK_V3_KEYS, DEEPSEEK_V3_DEFAULTS, _never,
                _attention_bias, qk_norm=False, window=_no_window, moe=DEEPSEEK_V3_MOE,
                hf_keys={"num_local_experts": "n_routed_experts"},
                interleaved_rope=lambda config: bool(config.rope_interleave), latent_attention=True),
)}
FAMILY_KEYS = frozenset(key for family in FAMILIES.values() for key in family.keys)
BY_ARCHITECTURE = {f.architecture: f for f in FAMILIES.values()}
BY_HF_MODEL_TYPE = {f.hf_type: f for f in FAMILIES.values()}
