"""The checks of a model family's own config keys (:class:`~llama_megatron.config.ModelConfig` calls them from its
validation; each raises :class:`ConfigError` with one line): mixtures of experts, Llama 4's layer lists, DeepSeek-V3's
latent attention and routing. ``self`` is the ModelConfig."""

from __future__ import annotations

from llama_megatron.errors import ConfigError
from llama_megatron.families import CHUNKED_ATTENTION


def check_experts(self) -> None:
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


def check_llama4(self) -> None:
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


def check_latent_attention(self) -> None:
    """DeepSeek-V3's keys: the latent ranks and head parts positive, the rotated part the head_dim RoPE uses,
    its routing the one written (noaux_tc over sigmoid scores), its expert groups dividing the experts."""
    for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_group", "topk_group"):
        value = getattr(self, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"model.{name} must be a positive integer, got {value!r}")
    rank = self.q_lora_rank
    if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0):
        raise ConfigError(f"model.q_lora_rank must be a positive integer or null (a plain q projection), got "
                          f"{rank!r}")
    if self.head_dim != self.qk_rope_head_dim:
        raise ConfigError(f"model.head_dim {self.head_dim} must be qk_rope_head_dim {self.qk_rope_head_dim}: the "
                          "rotated part of each head (or leave head_dim out)")
    if self.topk_method != "noaux_tc" or self.scoring_func != "sigmoid":
        raise ConfigError(f"model.topk_method {self.topk_method!r} with scoring_func {self.scoring_func!r} is not "
                          "supported: DeepSeek-V3's routing is topk_method 'noaux_tc' over scoring_func 'sigmoid'")
    experts = self.num_local_experts
    if isinstance(experts, int) and experts > 0 and experts % self.n_group:
        raise ConfigError(f"model.n_routed_experts {experts} is not divisible by n_group {self.n_group}")
    if self.topk_group > self.n_group:
        raise ConfigError(f"model.topk_group {self.topk_group} exceeds n_group {self.n_group}")
    if isinstance(experts, int) and experts > 0 and self.n_group > 1 and experts // self.n_group < 2:
        raise ConfigError(f"model.n_routed_experts {experts} over n_group {self.n_group} leaves groups of one "
                          "expert: a group is ranked by its two best scores")
    per_tok = self.num_experts_per_tok
    if isinstance(per_tok, int) and per_tok > self.topk_group * (experts // max(self.n_group, 1)):
        raise ConfigError(f"model.num_experts_per_tok {per_tok} exceeds the experts of topk_group "
                          f"{self.topk_group} groups")
    if not isinstance(self.n_shared_experts, int) or isinstance(self.n_shared_experts, bool) or \
            self.n_shared_experts <= 0:
        raise ConfigError(f"model.n_shared_experts must be a positive integer, got {self.n_shared_experts!r}")
    for name in ("first_k_dense_replace", "num_nextn_predict_layers"):
        value = getattr(self, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ConfigError(f"model.{name} must be an integer >= 0, got {value!r}")
    if self.output_router_logits:
        raise ConfigError("model.output_router_logits: DeepSeek-V3 balances its experts with the routing bias "
                          "(transformers adds no load-balancing loss to it), and its sequence-wise auxiliary loss "
                          "is not written: set it false")
    if not isinstance(self.routed_scaling_factor, (int, float)) or not self.routed_scaling_factor > 0:
        raise ConfigError(f"model.routed_scaling_factor must be > 0, got {self.routed_scaling_factor!r}")
