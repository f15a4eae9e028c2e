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

ROPE_TYPES = ("default", "linear", "dynamic", "llama3")

# Keys found in released HF LLaMA config.json files that carry no information for this model.
_HF_IGNORED_KEYS = {
    "torch_dtype", "dtype", "transformers_version", "use_cache",
    "pretraining_tp", "attention_dropout", "_name_or_path", "output_attentions", "output_hidden_states",
    "return_dict", "tie_encoder_decoder", "is_decoder", "chunk_size_feed_forward", "pruned_heads",
    "id2label", "label2id", "problem_type", "tokenizer_class", "_attn_implementation_autoset",
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

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
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
        if self.num_attention_heads % self.num_key_value_heads:
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
        if self.family.moe:
            self._validate_experts()

    def _validate_experts(self) -> None:
        experts, top_k = self.num_local_experts, self.num_experts_per_tok
        for name, value in (("num_local_experts", experts), ("num_experts_per_tok", top_k)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"model.{name} must be a positive integer, got {value!r}")
        if top_k > experts:
            raise ConfigError(f"model.num_experts_per_tok {top_k} exceeds num_local_experts {experts}")
        widths = [self.family.moe.width_key] + [self.family.moe.shared_width_key] * self.family.moe.shared_expert
        for name in (*widths, "decoder_sparse_step"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"model.{name} must be a positive integer, got {value!r}")
        only = self.mlp_only_layers
        if only is not None and (not isinstance(only, list) or any(
                not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < self.num_hidden_layers for i in only)):
            raise ConfigError(f"model.mlp_only_layers must list layer indices in [0, {self.num_hidden_layers}), "
                              f"got {only!r}")
        coef = self.router_aux_loss_coef
        if not isinstance(coef, (int, float)) or isinstance(coef, bool) or coef < 0:
            raise ConfigError(f"model.router_aux_loss_coef must be a number >= 0, got {coef!r}")
        if self.router_jitter_noise:
            raise ConfigError("model.router_jitter_noise must be 0: multiplicative router noise is random per "
                              "rank, so no parallel layout could reproduce it (set it to 0.0)")

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
            self._validate_llama4()
        if self.layer_types is not None:
            kinds = (FULL_ATTENTION, CHUNKED_ATTENTION) if self.model_type == "llama4" else (FULL_ATTENTION,
                                                                                              SLIDING_ATTENTION)
            if (not isinstance(self.layer_types, list) or len(self.layer_types) != self.num_hidden_layers
                    or any(kind not in kinds for kind in self.layer_types)):
                raise ConfigError(f"model.layer_types must list {self.num_hidden_layers} entries (one per layer) "
                                  f"of {' or '.join(kinds)}")

    def _validate_llama4(self) -> None:
        layers = self.num_hidden_layers
        chunk = self.attention_chunk_size
        if chunk is not None and (not isinstance(chunk, int) or isinstance(chunk, bool) or chunk <= 0):
            raise ConfigError(f"model.attention_chunk_size must be a positive integer or null, got {chunk!r}")
        if chunk is None and self.layer_types and CHUNKED_ATTENTION in self.layer_types:
            raise ConfigError("model.layer_types names chunked_attention layers and attention_chunk_size is null")
        rope = self.no_rope_layers
        if not isinstance(rope, list) or len(rope) != layers or any(r not in (0, 1) for r in rope):
            raise ConfigError(f"model.no_rope_layers must list {layers} entries of 1 (RoPE) or 0 (none), got {rope!r}")
        moe = self.moe_layers
        if not isinstance(moe, list) or any(not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < layers
                                            for i in moe):
            raise ConfigError(f"model.moe_layers must list layer indices in [0, {layers}), got {moe!r}")
        for name in ("floor_scale", "intermediate_size_mlp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"model.{name} must be a positive integer, got {value!r}")

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
        return getattr(self, moe.shared_width_key) if moe is not None and moe.shared_expert else 0

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

    def num_parameters(self) -> int:
        h, v, hd = self.hidden_size, self.vocab_size, self.head_dim
        attn = h * hd * (self.num_attention_heads + 2 * self.num_key_value_heads) + self.num_attention_heads * hd * h
        attn += hd * (self.num_attention_heads + 2 * self.num_key_value_heads) * self.qkv_bias + h * self.o_bias
        attn += 2 * hd * self.qk_norm
        mlp = sum(self.mlp_parameters(i, self.num_local_experts) for i in range(self.num_hidden_layers))
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


