"""Model families: the LLaMA-architecture decoders this package trains, one description each.

Every family is the LLaMA decoder (RMSNorm, RoPE, SwiGLU, GQA) with small additions; a :class:`ModelFamily` names
them once, and every reader asks it rather than keeping its own list:

- which Hugging Face config (``model_type``, ``architectures``) it is, and the architecture written on export;
- the config keys it accepts beyond the shared decoder's (``ModelConfig`` refuses the others);
- the parameters it adds (biases on q/k/v and o, per-head q/k RMSNorm weights), which
  :mod:`llama_megatron.model.param_layout` turns into rows of the one parameter table;
- its attention options: the sliding window of each layer (None: full causal attention).

=========  ===========================================================================================
llama      q/k/v/o biases and MLP biases when ``attention_bias`` / ``mlp_bias`` (LLaMA 1-3.x, Yi, ...)
mistral    sliding-window attention on every layer (``sliding_window``, None for full attention)
qwen2      q/k/v biases (never o); sliding windows on the layers ``layer_types`` names (or from
           ``max_window_layers`` on) when ``use_sliding_window``
qwen3      per-head RMSNorm on q and k before RoPE; q/k/v/o biases when ``attention_bias``; windows as qwen2
mixtral    Mistral's attention; the MLP replaced by a router and ``num_local_experts`` SwiGLU experts, of which
           each token uses ``num_experts_per_tok`` (:mod:`llama_megatron.model.moe`)
=========  ===========================================================================================
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"


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
    moe: bool = False  # every decoder layer's MLP is a mixture of experts (the family's keys say how many)

    def windows(self, config: Any) -> list[int | None]:
        return [self.window(config, i) for i in range(config.num_hidden_layers)]


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


MOE_KEYS = ("num_local_experts", "num_experts_per_tok", "router_aux_loss_coef", "output_router_logits",
            "router_jitter_noise")
MOE_DEFAULTS = {"num_local_experts": 8, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.001,
                "output_router_logits": False, "router_jitter_noise": 0.0}
QWEN_WINDOW_KEYS = ("use_sliding_window", "sliding_window", "max_window_layers", "layer_types")
QWEN_WINDOW_DEFAULTS = {"use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28}

FAMILIES: dict[str, ModelFamily] = {f.model_type: f for f in (
    ModelFamily("llama", "LlamaForCausalLM", ("attention_bias", "mlp_bias"), {}, _attention_bias, _attention_bias,
                qk_norm=False, window=_no_window),
    ModelFamily("mistral", "MistralForCausalLM", ("sliding_window",), {"sliding_window": 4096}, _never, _never,
                qk_norm=False, window=lambda c, i: c.sliding_window),
    ModelFamily("qwen2", "Qwen2ForCausalLM", QWEN_WINDOW_KEYS, QWEN_WINDOW_DEFAULTS, lambda c: True, _never,
                qk_norm=False, window=_qwen_window),
    ModelFamily("qwen3", "Qwen3ForCausalLM", ("attention_bias", *QWEN_WINDOW_KEYS), QWEN_WINDOW_DEFAULTS,
                _attention_bias, _attention_bias, qk_norm=True, window=_qwen_window),
    ModelFamily("mixtral", "MixtralForCausalLM", ("sliding_window", *MOE_KEYS), {"sliding_window": None, **MOE_DEFAULTS},
                _never, _never, qk_norm=False, window=lambda c, i: c.sliding_window, moe=True),
)}
FAMILY_KEYS = frozenset(key for family in FAMILIES.values() for key in family.keys)
BY_ARCHITECTURE = {f.architecture: f for f in FAMILIES.values()}
