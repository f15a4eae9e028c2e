"""Model configuration (the parallel degrees: parallel/degrees.py).

``ModelConfig`` uses Hugging Face config key names so that a released checkpoint's ``config.json`` loads as is,
both with the v4 keys (``rope_theta`` + ``rope_scaling``) and transformers 5's ``rope_parameters``. Its
``model_type`` (or ``architectures``) names the family (:mod:`llama_megatron.families`), which says which keys
beyond the shared decoder's it accepts. Every check raises :class:`ConfigError` with a one-line message.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any

from llama_megatron import family_checks
from llama_megatron.errors import ConfigError
from llama_megatron.families import (
    BY_ARCHITECTURE,
    BY_HF_MODEL_TYPE,
    CHUNKED_ATTENTION,
    FAMILIES,
    FAMILY_KEYS,
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    ModelFamily,
)

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")

# Keys found in released HF LLaMA config.json files that carry no information for this model.
_HF_IGNORED_KEYS = {
    "torch_dtype", "dtype", "transformers_version", "use_cache",
    "pretraining_tp", "attention_dropout", "_name_or_path", "output_attentions", "output_hidden_states",
    "return_dict", "tie_encoder_decoder", "is_decoder", "chunk_size_feed_forward", "pruned_heads",
    "id2label", "label2id", "problem_type", "tokenizer_class", "_attn_implementation_autoset", "is_encoder_decoder",
    # DeepSeek-V3's: derived (qk_nope_head_dim + qk_rope_head_dim), which transformers recomputes on load too
    "qk_head_dim",
}


@dataclass
class ModelConfig:
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    pad_token_id: int | None = None
    model_type: str = "llama"  # the family
    # family keys (families.py says whose): sliding-window attention
    sliding_window: int | None = None
    use_sliding_window: bool = False
    max_window_layers: int = 0
    layer_types: list[str] | None = None
    # family keys: mixture of experts (0 experts: a dense MLP)
    num_local_experts: int = 0  # experts per MoE layer (HF's name: all of them, not one rank's)
    num_experts_per_tok: int = 0
    router_aux_loss_coef: float = 0.0
    output_router_logits: bool = False  # HF adds the load-balancing loss to the training loss only when set
    router_jitter_noise: float = 0.0
    # family keys: Qwen's mixtures of experts (families.py): the experts' width (Mixtral's is intermediate_size,
    # which is the dense layers' width here), a shared expert's, whether the k routing weights are renormalised
    # (Mixtral always), and which layers route
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = False  # HF's default (Mixtral, which has no such key, always renormalises)
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] | None = None
    # family keys: Llama 4 (families.py): chunked attention, NoPE layers, q/k L2 norm, attention temperature, the
    # dense layers' width and the MoE layers
    attention_chunk_size: int | None = None
    no_rope_layers: list[int] | None = None  # per layer: 1 RoPE, 0 none (HF's name); from the interval when null
    no_rope_layer_interval: int = 4
    use_qk_norm: bool = False
    attn_temperature_tuning: bool = False
    floor_scale: int = 8192
    attn_scale: float = 0.1
    intermediate_size_mlp: int = 0
    moe_layers: list[int] | None = None  # from interleave_moe_layer_step when null
    interleave_moe_layer_step: int = 1
    # family keys: DeepSeek-V3 (families.py): multi-head latent attention (q through a q_lora_rank latent, or a plain
    # projection when null; k and v from one kv_lora_rank latent per token, shared by the heads, plus one
    # qk_rope_head_dim key part every head shares; head_dim is qk_rope_head_dim, HF's), sigmoid routing over n_group
    # groups of experts with a learned correction bias, shared experts, dense first layers, multi-token prediction
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    n_shared_experts: int = 0
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    first_k_dense_replace: int = 0
    rope_interleave: bool = False
    num_nextn_predict_layers: int = 0
    topk_method: str = "noaux_tc"  # the released config.json's names of V3's routing (the only one written)
    scoring_func: str = "sigmoid"

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None and self.qk_rope_head_dim:
            self.head_dim = self.qk_rope_head_dim  # MLA: the rotated part of a head (HF's DeepseekV3Config)
        if self.head_dim is None:
            if self.num_attention_heads <= 0 or self.hidden_size % self.num_attention_heads:
                raise ConfigError(
                    f"hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                    f"{self.num_attention_heads} and no head_dim is given"
                )
            self.head_dim = self.hidden_size // self.num_attention_heads
        self.rope_scaling = _normalise_rope_scaling(self.rope_scaling)
        if self.model_type == "llama4":
            self._derive_llama4_layers()
        self.validate()

    def _derive_llama4_layers(self) -> None:
        """HF's Llama4TextConfig: RoPE layers, MoE layers and layer types from their intervals where not listed."""
        layers, interval = self.num_hidden_layers, self.no_rope_layer_interval
        if not isinstance(interval, int) or isinstance(interval, bool) or interval <= 0:
            raise ConfigError(f"model.no_rope_layer_interval must be a positive integer, got {interval!r}")
        step = self.interleave_moe_layer_step
        if not isinstance(step, int) or isinstance(step, bool) or step <= 0:
            raise ConfigError(f"model.interleave_moe_layer_step must be a positive integer, got {step!r}")
        if not self.no_rope_layers:
            self.no_rope_layers = [int((i + 1) % interval != 0) for i in range(layers)]
        if self.moe_layers is None:
            self.moe_layers = list(range(step - 1, layers, step))
        if self.layer_types is None and isinstance(self.no_rope_layers, list):  # (no chunk size: no chunked layer)
            chunked = self.attention_chunk_size is not None
            self.layer_types = [CHUNKED_ATTENTION if rope and chunked else FULL_ATTENTION for rope in self.no_rope_layers]

    def validate(self) -> None:
        if self.model_type not in FAMILIES:
            raise ConfigError(f"model_type {self.model_type!r} is not supported (choose from "
                              f"{', '.join(FAMILIES)})")
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        for key in sorted(FAMILY_KEYS - set(self.family.keys)):
            if getattr(self, key) != defaults[key]:
                raise ConfigError(f"model.{key} is not a key of the {self.model_type} family")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"model.{name} must be a positive integer, got {value!r}")
        # (multi-head latent attention has no KV heads: its keys and values are per query head; the key is unread)
        if self.num_attention_heads % self.num_key_value_heads and not self.family.latent_attention:
            raise ConfigError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim {self.head_dim} must be even for rotary embeddings")
        if self.hidden_act != "silu":
            raise ConfigError(f"hidden_act {self.hidden_act!r} is not supported: LLaMA uses 'silu'")
        if self.rms_norm_eps <= 0 or self.rope_theta <= 0:
            raise ConfigError("rms_norm_eps and rope_theta must be positive")
        self._validate_windows()
        if self.family.latent_attention:
            family_checks.check_latent_attention(self)
        if self.family.moe:
            family_checks.check_experts(self)

    @property
    def qk_head_dim(self) -> int:
        """A query's and key's width per head under MLA (the unrotated part, then the rotated)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def _validate_windows(self) -> None:
        window = self.sliding_window
        if window == 0 and "use_sliding_window" in self.family.keys and not self.use_sliding_window:
            # what transformers' Qwen2-MoE config writes for "no window" (the family reads no window then)
            window = None
        if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window <= 0):
            raise ConfigError(f"model.sliding_window must be a positive integer or null, got {window!r}")
        if not isinstance(self.max_window_layers, int) or self.max_window_layers < 0:
            raise ConfigError(f"model.max_window_layers must be an integer >= 0, got {self.max_window_layers!r}")
        if self.model_type == "llama4":
            family_checks.check_llama4(self)
        if self.layer_types is not None:
            kinds = (FULL_ATTENTION, CHUNKED_ATTENTION) if self.model_type == "llama4" else (FULL_ATTENTION,
                                                                                              SLIDING_ATTENTION)
            if (not isinstance(self.layer_types, list) or len(self.layer_types) != self.num_hidden_layers
                    or any(kind not in kinds for kind in self.layer_types)):
                raise ConfigError(f"model.layer_types must list {self.num_hidden_layers} entries (one per layer) "
                                  f"of {' or '.join(kinds)}")

    @property
    def family(self) -> ModelFamily:
        return FAMILIES[self.model_type]

    @property
    def qkv_bias(self) -> bool:
        return self.family.qkv_bias(self)

    @property
    def o_bias(self) -> bool:
        return self.family.o_bias(self)

    @property
    def qk_norm(self) -> bool:
        return self.family.qk_norm

    @property
    def dense_intermediate_size(self) -> int:
        """A dense layer's FFN width (Llama 4's ``intermediate_size_mlp``; ``intermediate_size`` elsewhere)."""
        return getattr(self, self.family.dense_width_key)

    @property
    def shared_intermediate_size(self) -> int:
        """The shared expert's FFN width (0 without one)."""
        moe = self.family.moe
        if moe is None or not moe.shared_expert:
            return 0
        return getattr(self, moe.shared_width_key) * (getattr(self, moe.shared_count_key) if moe.shared_count_key else 1)

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` (0-based) routes its tokens to experts (else it has a dense MLP)."""
        return self.family.moe is not None and self.family.moe.routed(self, layer)

    @property
    def expert_intermediate_size(self) -> int:
        """One routed expert's FFN width (0 for a dense family)."""
        return getattr(self, self.family.moe.width_key) if self.family.moe else 0

    def layer_windows(self) -> list[int | None]:
        """The sliding window of each decoder layer in tokens (a query sees itself and the window - 1 before it),
        None where attention is fully causal."""
        return self.family.windows(self)

    def layer_chunks(self) -> list[int | None]:
        """The attention chunk of each decoder layer in tokens (Llama 4's chunked layers), None elsewhere."""
        return [self.family.chunk(self, i) for i in range(self.num_hidden_layers)]

    @property
    def rope_type(self) -> str:
        return "default" if self.rope_scaling is None else self.rope_scaling["rope_type"]

    @property
    def num_query_groups(self) -> int:
        return self.num_key_value_heads

    @property
    def queries_per_group(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def attention_matmul_weights(self) -> int:
        """One layer's attention weights that multiply its tokens (no norm, no bias): grouped-query attention's q, k,
        v and o; multi-head latent attention's down-projections (q's latent, or q itself; the kv latent with the
        shared rotated key part), up-projections and o."""
        h, heads = self.hidden_size, self.num_attention_heads
        if not self.family.latent_attention:
            hd = self.head_dim
            return h * hd * (heads + 2 * self.num_key_value_heads) + heads * hd * h
        q_rows = heads * self.qk_head_dim
        q = h * q_rows if self.q_lora_rank is None else self.q_lora_rank * (h + q_rows)
        kv = h * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank * heads * (
            self.qk_nope_head_dim + self.v_head_dim)
        return q + kv + heads * self.v_head_dim * h

    def kv_cache_widths(self, tensor: int = 1) -> tuple[int, int, int]:
        """What a TP rank's KV cache holds per layer and position: (heads, key width, value width); multi-head latent
        attention's latent and the shared rotated key part, one "head" every TP rank holds whole, no value."""
        if self.family.latent_attention:
            return 1, self.kv_lora_rank + self.qk_rope_head_dim, 0
        return self.num_key_value_heads // tensor, self.head_dim, self.head_dim

    def attention_score_width(self) -> int:
        """Per query head and key, the width of its q.k product plus its weighted value's (QK^T and AV)."""
        if self.family.latent_attention:
            return self.qk_head_dim + self.v_head_dim
        return 2 * self.head_dim

    def _attention_parameters(self) -> int:
        """One layer's attention parameters: its matmul weights, biases and norms."""
        h, hd = self.hidden_size, self.head_dim
        if self.family.latent_attention:
            q_rank = self.q_lora_rank or 0
            latents = q_rank + self.kv_lora_rank  # their norms
            biases = (q_rank + self.kv_lora_rank + self.qk_rope_head_dim) * self.attention_bias + h * self.o_bias
            return self.attention_matmul_weights() + latents + biases
        attn = self.attention_matmul_weights()
        attn += hd * (self.num_attention_heads + 2 * self.num_key_value_heads) * self.qkv_bias + h * self.o_bias
        return attn + 2 * hd * self.qk_norm

    def num_parameters(self) -> int:
        h, v = self.hidden_size, self.vocab_size
        attn = self._attention_parameters()
        mlp = sum(self.mlp_parameters(i, self.num_local_experts) for i in range(self.num_hidden_layers))
        if self.family.moe is not None and self.family.moe.router_bias:  # not a matmul's: apart from mlp_parameters
            mlp += self.num_local_experts * sum(map(self.is_moe_layer, range(self.num_hidden_layers)))
        embeddings = v * h * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * (attn + 2 * h) + mlp + embeddings + h

    def num_active_parameters(self) -> int:
        """Parameters one token passes through: a mixture of experts counts its router, its shared expert and the
        ``num_experts_per_tok`` experts a token uses (the convention of Mixtral's "12.9B active" and Qwen3's
        "A3B"); the whole model when dense."""
        unused = sum(self.mlp_parameters(i, self.num_local_experts) - self.mlp_parameters(i, self.num_experts_per_tok)
                     for i in range(self.num_hidden_layers))
        return self.num_parameters() - unused

    def mlp_parameters(self, layer: int, experts: int) -> int:
        """Decoder layer ``layer``'s MLP counting ``experts`` routed experts: a dense SwiGLU (with biases when
        ``mlp_bias``), or a router, the experts and a shared expert with its gate when the family has one."""
        h = self.hidden_size
        if not self.is_moe_layer(layer):
            ffn = self.dense_intermediate_size
            return 3 * h * ffn + (2 * ffn + h if self.mlp_bias else 0)
        moe = self.family.moe
        shared = (3 * self.shared_intermediate_size + moe.shared_expert_gated) * h if moe.shared_expert else 0
        return experts * 3 * h * self.expert_intermediate_size + self.num_local_experts * h + shared

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        data = dict(data)
        text = data.get("text_config")
        if isinstance(text, dict) and "model_type" in text:  # a multimodal checkpoint (Llama 4): its text model
            inner = BY_HF_MODEL_TYPE.get(text["model_type"]) or FAMILIES.get(text["model_type"])
            if inner is not None and inner.multimodal_prefix:
                data = {"tie_word_embeddings": data.get("tie_word_embeddings", False), **text}
        rope_parameters = data.pop("rope_parameters", None)
        if rope_parameters is not None:
            rope_parameters = dict(rope_parameters)
            if "rope_theta" in rope_parameters:
                data["rope_theta"] = rope_parameters.pop("rope_theta")
            rope_type = rope_parameters.get("rope_type", rope_parameters.get("type", "default"))
            if rope_type != "default" and data.get("rope_scaling") is None:
                data["rope_scaling"] = rope_parameters
        family = _family_of(data)
        data["model_type"] = family.model_type
        for ours, theirs in family.hf_keys.items():  # the HF config class's names for our keys
            if theirs in data:
                if ours in data:
                    raise ConfigError(f"model.{ours} and model.{theirs} name the same key of the "
                                      f"{family.model_type} family: give one")
                data[ours] = data.pop(theirs)
        data = {**family.defaults, **data}
        known = {f.name for f in dataclasses.fields(cls)} - (FAMILY_KEYS - set(family.keys))
        unknown = set(data) - known - _HF_IGNORED_KEYS
        if unknown:
            raise ConfigError(f"unknown model config keys for the {family.model_type} family: "
                              f"{', '.join(sorted(unknown))}")
        return cls(**{k: v for k, v in data.items() if k in known})

    @classmethod
    def from_file(cls, path: str) -> ModelConfig:
        """Load a model config: a preset JSON, or an HF ``config.json`` (or its directory)."""
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        return cls.from_dict(read_json(path, "model config"))

    def to_dict(self) -> dict[str, Any]:
        """Every key of the config's family (another family's keys are not part of it)."""
        others = FAMILY_KEYS - set(self.family.keys)
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in others}

    def to_hf_dict(self) -> dict[str, Any]:
        """Keys for the family's transformers config class (v4 and v5 both accept ``rope_theta``/``rope_scaling``)."""
        renamed = {self.family.hf_keys.get(key, key): value for key, value in self.to_dict().items()}
        return {**renamed, "model_type": self.family.hf_type, "architectures": [self.family.architecture]}


def _family_of(data: dict[str, Any]) -> ModelFamily:
    """The family an HF config names (``model_type``, else ``architectures``; LLaMA when neither)."""
    model_type = data.pop("model_type", None)
    architectures = data.pop("architectures", None) or []
    if model_type is not None and model_type not in FAMILIES and model_type in BY_HF_MODEL_TYPE:
        model_type = BY_HF_MODEL_TYPE[model_type].model_type  # the HF config's name (llama4_text)
    if model_type is not None and model_type not in FAMILIES:
        raise ConfigError(f"model_type {model_type!r} is not supported (choose from {', '.join(FAMILIES)})")
    named = [BY_ARCHITECTURE[a] for a in architectures if a in BY_ARCHITECTURE]
    if model_type is None and architectures and not named:
        raise ConfigError(f"architectures {architectures} name no supported family (choose from "
                          f"{', '.join(BY_ARCHITECTURE)})")
    family = FAMILIES[model_type] if model_type is not None else (named[0] if named else FAMILIES["llama"])
    if named and named[0] is not family:
        raise ConfigError(f"model_type {model_type!r} and architectures {architectures} name different families")
    return family


def _normalise_rope_scaling(scaling: dict[str, Any] | None) -> dict[str, Any] | None:
    if scaling is None:
        return None
    scaling = dict(scaling)
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    if rope_type not in ROPE_TYPES:
        raise ConfigError(f"rope_scaling type {rope_type!r} is not supported (choose from {', '.join(ROPE_TYPES)})")
    if rope_type == "default":
        return None
    factor = scaling.get("factor")
    if not isinstance(factor, (int, float)) or factor < 1:
        raise ConfigError(f"rope_scaling.factor must be a number >= 1 for {rope_type!r}, got {factor!r}")
    if rope_type == "llama3":
        for key in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            if key not in scaling:
                raise ConfigError(f"rope_scaling of type 'llama3' needs {key}")
        if scaling["high_freq_factor"] < scaling["low_freq_factor"]:  # equal (Llama 4 Scout): no band between
            raise ConfigError("rope_scaling.high_freq_factor must not be below low_freq_factor")
    if rope_type == "yarn" and not isinstance(scaling.get("original_max_position_embeddings"), int):
        raise ConfigError("rope_scaling of type 'yarn' needs original_max_position_embeddings (an integer)")
    return {"rope_type": rope_type, **scaling}


def read_json(path: str, what: str = "config") -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"{what} not found: {path}") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{what} {path} is not valid JSON: line {exc.lineno}: {exc.msg}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{what} {path} must hold a JSON object")
    return data


