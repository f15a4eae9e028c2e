"""The model's parameters as one table: names, Hugging Face tensors and shapes, TP split, pipeline layer.

Everything that needs to know what a parameter *is* reads it here: initialisation, conversion from and to HF,
the checkpoint readers and writers, DeepSpeed's universal-checkpoint patterns, export. The parallel layers
carry the same split on the parameter they create (``param.tp_split``); a test checks the two agree, so a new
parameter is one new row here plus the layer that owns it. Parameters added to the model for one kind of run (LoRA
adapters) have a table of their own, a :class:`ParamLayout` built from other rows (:mod:`.lora_layout`).

Three names per parameter:

- module name, as the model registers it (PipelineModule naming): ``3.self_attn.qkv_proj.weight``, or
  ``tied_modules.embed.word_embeddings.weight`` for a tied embedding;
- canonical name, free of layout: ``layers.2.self_attn.qkv_proj.weight``, ``embed.weight``, ``norm.weight``,
  ``lm_head.weight``;
- the HF tensors it is made of, in fused order: ``model.layers.2.self_attn.{q,k,v}_proj.weight``.

Pipeline layer indices (they name parameters and checkpoint files, so they never change): 0 embedding,
1..L decoder layers, L+1 final norm, L+2 LM head (with tied embeddings the head reuses layer 0's table).

Splits over TP: ``vocab`` (rows of the padded vocabulary), ``qkv`` (per KV group ``[q heads | k | v]``),
``gate_up`` (``cat(gate[rank rows], up[rank rows])``), ``column`` (a plain block of output rows), ``row``
(input columns), ``replicated``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from llama_megatron.config import ModelConfig
from llama_megatron.model import released_tensors

SPLITS = ("vocab", "qkv", "gate_up", "column", "row", "replicated")
TIED_PREFIX = "tied_modules.embed."


@dataclass(frozen=True)
class ParamSpec:
    name: str  # canonical
    hf_names: tuple[str, ...]
    hf_shapes: tuple[tuple[int, ...], ...]
    split: str
    layers: tuple[int, ...]  # pipeline layers holding it (two for a tied embedding); files live under layers[0]
    module_name: str
    init: str  # "normal" (N(0, initializer_range)), "ones" or "zeros"
    expert: int | None = None  # the MoE expert it belongs to (global id): only its expert-parallel rank holds it

    @property
    def layer_key(self) -> str:
        """Key inside its pipeline layer file: the module name without the layer prefix."""
        if self.module_name.startswith(TIED_PREFIX):
            return self.module_name.removeprefix(TIED_PREFIX)
        return self.module_name.split(".", 1)[1]


def embedding_layer() -> int:
    return 0


def final_norm_layer(config: ModelConfig) -> int:
    return config.num_hidden_layers + 1


def lm_head_layer(config: ModelConfig) -> int:
    return config.num_hidden_layers + 2


class ParamLayout:
    """Every parameter of the model for ``config``, in layer order; ``specs`` replaces the model's own rows for
    a table of added parameters (the LoRA adapters of :mod:`llama_megatron.model.lora_layout`)."""

    def __init__(self, config: ModelConfig, specs: list[ParamSpec] | None = None) -> None:
        self.config = config
        self.specs: tuple[ParamSpec, ...] = tuple(_specs(config) if specs is None else specs)
        self._by_name = {s.name: s for s in self.specs}
        self._by_module = {s.module_name: s for s in self.specs}
        self._by_hf = {hf: s for s in self.specs for hf in s.hf_names}

    def __iter__(self):
        return iter(self.specs)

    def __getitem__(self, canonical: str) -> ParamSpec:
        try:
            return self._by_name[canonical]
        except KeyError:
            raise KeyError(f"not a parameter of this model: {canonical}") from None

    def for_module(self, module_name: str) -> ParamSpec:
        try:
            return self._by_module[module_name]
        except KeyError:
            raise KeyError(f"not a parameter of this model: {module_name}") from None

    def for_hf(self, hf_name: str) -> ParamSpec:
        try:
            return self._by_hf[hf_name]
        except KeyError:
            raise KeyError(f"not an HF tensor of this model: {hf_name}") from None

    def held_by(self, ep_rank: int, ep_size: int) -> list[ParamSpec]:
        """The rows an expert-parallel rank holds: everything but the experts of the other EP ranks."""
        per_rank = self.config.num_local_experts // ep_size
        return [s for s in self.specs if s.expert is None or s.expert // per_rank == ep_rank]

    def numel_by_layer(self) -> dict[int, int]:
        """Elements of the full (unsharded) parameters stored under each pipeline layer index."""
        out: dict[int, int] = {}
        for spec in self.specs:
            out[spec.layers[0]] = out.get(spec.layers[0], 0) + sum(math.prod(s) for s in spec.hf_shapes)
        return out

    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every HF tensor the config implies (no ``lm_head.weight`` when embeddings are tied), in layer order."""
        return {hf: shape for s in self.specs for hf, shape in zip(s.hf_names, s.hf_shapes)}


def _specs(config: ModelConfig) -> list[ParamSpec]:
    h, hd, ffn, vocab = config.hidden_size, config.head_dim, config.dense_intermediate_size, config.vocab_size
    mlp = config.family.mlp_name
    q_rows, kv_rows = config.num_attention_heads * hd, config.num_key_value_heads * hd
    tied = config.tie_word_embeddings
    embed_module = f"{TIED_PREFIX}word_embeddings.weight" if tied else "0.word_embeddings.weight"
    embed_layers = (0, lm_head_layer(config)) if tied else (0,)
    specs = [ParamSpec("embed.weight", ("model.embed_tokens.weight",), ((vocab, h),), "vocab", embed_layers,
                       embed_module, "normal")]
    for i in range(config.num_hidden_layers):
        def row(leaf: str, hf_leaves: list[str], shapes: list[tuple[int, ...]], split: str, init: str,
                i: int = i, expert: int | None = None) -> ParamSpec:
            return ParamSpec(f"layers.{i}.{leaf}", tuple(f"model.layers.{i}.{n}" for n in hf_leaves),
                             tuple(shapes), split, (i + 1,), f"{i + 1}.{leaf}", init, expert)

        specs.append(row("input_layernorm.weight", ["input_layernorm.weight"], [(h,)], "replicated", "ones"))
        if config.family.latent_attention:
            specs += _latent_attention_rows(config, row)
        else:
            specs.append(row("self_attn.qkv_proj.weight", [f"self_attn.{p}_proj.weight" for p in "qkv"],
                             [(q_rows, h), (kv_rows, h), (kv_rows, h)], "qkv", "normal"))
            if config.qkv_bias:
                specs.append(row("self_attn.qkv_proj.bias", [f"self_attn.{p}_proj.bias" for p in "qkv"],
                                 [(q_rows,), (kv_rows,), (kv_rows,)], "qkv", "zeros"))
            if config.qk_norm:  # one weight over head_dim, shared by every head: replicated over TP
                specs += [row(f"self_attn.{p}_norm.weight", [f"self_attn.{p}_norm.weight"], [(hd,)], "replicated",
                              "ones") for p in "qk"]
            specs.append(row("self_attn.o_proj.weight", ["self_attn.o_proj.weight"], [(h, q_rows)], "row",
                             "normal"))
        if config.o_bias:
            specs.append(row("self_attn.o_proj.bias", ["self_attn.o_proj.bias"], [(h,)], "replicated", "zeros"))
        specs.append(row("post_attention_layernorm.weight", ["post_attention_layernorm.weight"], [(h,)],
                         "replicated", "ones"))
        if config.is_moe_layer(i):
            specs += _moe_rows(config, row)
            continue
        specs.append(row("mlp.gate_up_proj.weight", [f"{mlp}.gate_proj.weight", f"{mlp}.up_proj.weight"],
                         [(ffn, h), (ffn, h)], "gate_up", "normal"))
        if config.mlp_bias:
            specs.append(row("mlp.gate_up_proj.bias", [f"{mlp}.gate_proj.bias", f"{mlp}.up_proj.bias"],
                             [(ffn,), (ffn,)], "gate_up", "zeros"))
        specs.append(row("mlp.down_proj.weight", [f"{mlp}.down_proj.weight"], [(h, ffn)], "row", "normal"))
        if config.mlp_bias:
            specs.append(row("mlp.down_proj.bias", [f"{mlp}.down_proj.bias"], [(h,)], "replicated", "zeros"))
    norm = final_norm_layer(config)
    specs.append(ParamSpec("norm.weight", ("model.norm.weight",), ((h,),), "replicated", (norm,),
                           f"{norm}.norm.weight", "ones"))
    if not tied:
        head = lm_head_layer(config)
        specs.append(ParamSpec("lm_head.weight", ("lm_head.weight",), ((vocab, h),), "vocab", (head,),
                               f"{head}.lm_head.weight", "normal"))
    return specs



def _latent_attention_rows(config: ModelConfig, row) -> list[ParamSpec]:
    """Multi-head latent attention's rows (DeepSeek-V3, HF's names): the down-projections into the q latent
    (``q_a_proj``, with its norm) and into the kv latent with the shared rotated key part (``kv_a_proj_with_mqa``,
    the latent's norm) are replicated over TP; the up-projections (``q_b_proj``, or ``q_proj`` without a q latent,
    and ``kv_b_proj``) split their rows, head after head, and ``o_proj`` its columns."""
    h, heads, rank = config.hidden_size, config.num_attention_heads, config.kv_lora_rank
    q_rows = heads * config.qk_head_dim
    bias = config.attention_bias
    rows = []
    if config.q_lora_rank is None:
        rows.append(row("self_attn.q_proj.weight", ["self_attn.q_proj.weight"], [(q_rows, h)], "column", "normal"))
    else:
        q_rank = config.q_lora_rank
        rows.append(row("self_attn.q_a_proj.weight", ["self_attn.q_a_proj.weight"], [(q_rank, h)], "replicated",
                        "normal"))
        if bias:
            rows.append(row("self_attn.q_a_proj.bias", ["self_attn.q_a_proj.bias"], [(q_rank,)], "replicated",
                            "zeros"))
        rows += [row("self_attn.q_a_layernorm.weight", ["self_attn.q_a_layernorm.weight"], [(q_rank,)],
                     "replicated", "ones"),
                 row("self_attn.q_b_proj.weight", ["self_attn.q_b_proj.weight"], [(q_rows, q_rank)], "column",
                     "normal")]
    kv_a = rank + config.qk_rope_head_dim
    rows.append(row("self_attn.kv_a_proj_with_mqa.weight", ["self_attn.kv_a_proj_with_mqa.weight"], [(kv_a, h)],
                    "replicated", "normal"))
    if bias:
        rows.append(row("self_attn.kv_a_proj_with_mqa.bias", ["self_attn.kv_a_proj_with_mqa.bias"], [(kv_a,)],
                        "replicated", "zeros"))
    kv_b = heads * (config.qk_nope_head_dim + config.v_head_dim)
    rows += [row("self_attn.kv_a_layernorm.weight", ["self_attn.kv_a_layernorm.weight"], [(rank,)], "replicated",
                 "ones"),
             row("self_attn.kv_b_proj.weight", ["self_attn.kv_b_proj.weight"], [(kv_b, rank)], "column", "normal"),
             row("self_attn.o_proj.weight", ["self_attn.o_proj.weight"], [(h, heads * config.v_head_dim)], "row",
                 "normal")]
    return rows


def _moe_rows(config: ModelConfig, row) -> list[ParamSpec]:
    """One MoE layer's rows under the released checkpoints' names (the family's): Mixtral's ``block_sparse_moe``
    with experts' ``w1`` (gate), ``w3`` (up), ``w2`` (down); Qwen's ``mlp`` with ``gate_proj``, ``up_proj``,
    ``down_proj`` and Qwen2-MoE's ``shared_expert`` and ``shared_expert_gate``. The router is ``gate`` in both,
    Llama 4's ``feed_forward.router``; Llama 4's files hold the experts fused, and these per-expert names are the
    table's own (:mod:`llama_megatron.model.released_tensors` maps them)."""
    moe, h, ffn = config.family.moe, config.hidden_size, config.expert_intermediate_size
    gate, up, down = moe.leaves
    rows = [row("mlp.router.weight", [f"{moe.block}.{moe.router}.weight"], [(config.num_local_experts, h)],
                "replicated", "normal")]
    if moe.router_bias:  # DeepSeek-V3's correction bias: moved by the experts' loads, not trained
        rows.append(row("mlp.router.e_score_correction_bias", [f"{moe.block}.{moe.router}.e_score_correction_bias"],
                        [(config.num_local_experts,)], "replicated", "zeros"))
    for e in range(config.num_local_experts):
        expert = f"{moe.block}.experts.{e}"
        rows += [row(f"mlp.experts.{e}.gate_up_proj.weight", [f"{expert}.{gate}.weight", f"{expert}.{up}.weight"],
                     [(ffn, h), (ffn, h)], "gate_up", "normal", expert=e),
                 row(f"mlp.experts.{e}.down_proj.weight", [f"{expert}.{down}.weight"], [(h, ffn)], "row", "normal",
                     expert=e)]
    if moe.shared_expert:
        shared, width = f"{moe.block}.{moe.shared_name}", config.shared_intermediate_size
        rows += [row("mlp.shared_expert.gate_up_proj.weight", [f"{shared}.gate_proj.weight", f"{shared}.up_proj.weight"],
                     [(width, h), (width, h)], "gate_up", "normal"),
                 row("mlp.shared_expert.down_proj.weight", [f"{shared}.down_proj.weight"], [(h, width)], "row",
                     "normal")]
        if moe.shared_expert_gated:
            rows.append(row("mlp.shared_expert_gate.weight", [f"{moe.block}.shared_expert_gate.weight"], [(1, h)],
                            "replicated", "normal"))
    return rows


def as_checkpoint_tensors(state: dict, config: ModelConfig) -> dict:
    """A transformers model's state dict under the table's (the released checkpoints') names.

    transformers 5 holds each MoE layer's experts fused, ``mlp.experts.gate_up_proj`` [E, 2 x ffn, h] (gate rows,
    then up) and ``mlp.experts.down_proj`` [E, h, ffn], and the router as ``mlp.gate``; it saves them per expert, as
    released (the family's names, :func:`_moe_rows`): Mixtral's ``block_sparse_moe.experts.{e}.w1`` (gate), ``w3``
    (up), ``w2`` (down), ``block_sparse_moe.gate``; Qwen's ``mlp.experts.{e}.gate_proj`` ... This does the same
    renaming in memory, as views. Dense families' state dicts are returned as they are. Llama 4 saves its experts
    fused as it holds them, and rotates interleaved q/k pairs: :mod:`.released_tensors` maps its tensors.
    """
    moe = config.family.moe
    if moe is not None and moe.fused_expert_files:  # Llama 4: released_tensors maps its experts and rows
        return released_tensors.table_tensors(state, config)
    out = experts_apart(state, config) if moe is not None else state
    # DeepSeek-V3: its rotated q/k rows interleaved, as released (model/released_tensors.py)
    return released_tensors.table_tensors(out, config) if released_tensors.differs(config) else out


def experts_apart(state: dict, config: ModelConfig) -> dict:
    """transformers 5's fused experts and ``mlp.gate`` router of each MoE layer under the released per-expert
    names (as_checkpoint_tensors)."""
    moe = config.family.moe
    out, ffn = {}, config.expert_intermediate_size
    gate, up, down = moe.leaves
    for name, tensor in state.items():
        prefix, fused, leaf = name.partition(".mlp.")
        if leaf == "gate.weight":
            out[f"{prefix}.{moe.block}.gate.weight"] = tensor
        elif leaf in ("experts.gate_up_proj", "experts.down_proj"):
            for e in range(config.num_local_experts):
                expert = f"{prefix}.{moe.block}.experts.{e}"
                if leaf == "experts.down_proj":
                    out[f"{expert}.{down}.weight"] = tensor[e]
                else:
                    out[f"{expert}.{gate}.weight"], out[f"{expert}.{up}.weight"] = tensor[e, :ffn], tensor[e, ffn:]
        elif not fused or moe.block == "mlp":  # a dense layer's or a shared expert's MLP is named as released
            out[name] = tensor
        else:
            raise KeyError(f"not a {config.model_type} MLP tensor: {name}")
    return out
