"""LoRA adapters as a table: the ``lora`` config section and one :class:`ParamSpec` per adapter matrix.

Targets use Hugging Face / PEFT module names (``q_proj`` ... ``down_proj``), one (A, B) pair per target even where
our linear is fused (q/k/v in ``qkv_proj``, gate/up in ``gate_up_proj``), so an exported adapter is a plain
renaming. A mixture of experts' MLP has no modules for PEFT to target: its experts are two parameters per layer,
which PEFT adapts with ``target_parameters`` (``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``), one
(A, B) pair per expert (gate and up share A, as they share the fused weight); the table holds one row per expert and
matrix, which :func:`to_peft` / :func:`from_peft` fuse into PEFT's per-layer tensors and back (Llama 4's experts,
stored ``[E, in, out]``, PEFT adapts as if they were ``[E, out, in]``: its A and B are ours transposed and swapped). ``A`` is
``[rank, in]``, ``B`` is ``[out, rank]``, ``delta W = B @ A * alpha / rank`` (PEFT's convention). The MLP targets
(``gate_proj``, ``up_proj``, ``down_proj``) are what PEFT adapts under those names on the transformers class: a dense
model's MLP; on Qwen2-MoE the dense layers' MLPs and the MoE layers' shared expert; nothing on Mixtral or Qwen3-MoE
(:attr:`~llama_megatron.families.MoEFamily.mlp_module_targets`, :func:`layer_target`). How each matrix splits over TP
follows its weight:

- column-parallel targets (q, k, v, gate, up): ``B`` splits on its rows as the weight's rows do; for q/k/v the rows
  of the KV groups a rank owns are one contiguous block of each of q, k, v, so every ``B`` is a plain ``column``
  split. ``A`` is ``replicated`` (its gradient is summed over TP in the forward, see :mod:`.lora`).
- row-parallel targets (o, down): ``A`` splits on its input columns (``row``), ``B`` is ``replicated``.

Modules trained in full beside the adapters (PEFT's ``modules_to_save``: the embedding, the LM head, the norms) are
base parameters left trainable: the table holds their base rows (same module name, split and pipeline layer: the
embedding and head vocab-parallel over the padded vocab, the norms replicated) under PEFT's keys
(``base_model.model.lm_head.weight``), so everything that reads or writes an adapter checkpoint handles them as it
handles the adapters. PEFT selects a module when its qualified name ends with a listed name (``_set_trainable``'s
``key.endswith(name)``): ``norm`` is every norm of the class, ``model.norm`` the final one alone. A tied embedding
is one table for the embedding and the head: ``embed_tokens`` or ``lm_head`` trains it, as PEFT does with
``ensure_weight_tying=True`` (without it PEFT would train an untied copy of one of them).

The specs live in a :class:`ParamLayout` of their own (never in the base model's), so initialisation, conversion
and checkpoint code that walk the base layout see exactly the base parameters; the same slicing code
(:mod:`.tp_slicing`) cuts and merges both. A row's ``hf_names`` is its PEFT key
(``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from llama_megatron.config import ModelConfig
from llama_megatron.errors import ConfigError
from llama_megatron.model import released_tensors
from llama_megatron.model.param_layout import ParamLayout, ParamSpec

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# PEFT's target_parameters of a mixture of experts, in the order MixtralExperts registers them
EXPERT_TARGETS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
PEFT_PREFIX = "base_model.model."
# PEFT's modules_to_save names this accepts: those that select, by PEFT's suffix rule, only embeddings, heads and
# norms on every family's class ("norm": all of them; "q_norm" / "k_norm": Qwen3's per-head norms)
MODULES_TO_SAVE = ("embed_tokens", "lm_head", "norm", "model.norm", "input_layernorm", "post_attention_layernorm",
                   "q_norm", "k_norm")
EMBED_MODULE, HEAD_MODULE = "model.embed_tokens", "lm_head"  # HF module names of the two vocab tables
ADAPTER_MODULE = "lora"  # the attribute of our linear layers that holds a LoRA adapter (parallel/layers.py)


@dataclass(frozen=True)
class Target:
    """Where an HF target lives in our model: the (possibly fused) linear, and its HF module path."""

    name: str  # q_proj
    linear: str  # self_attn.qkv_proj (an expert's: mlp.experts.{e}.gate_up_proj)
    hf_module: str  # self_attn.q_proj
    parallel: str  # "column" or "row"
    expert: bool = False  # a parameter of every expert (PEFT's target_parameters), not a module

    def linear_of(self, expert: int | None) -> str:
        return self.linear.format(e=expert)


TARGETS = {t.name: t for t in (
    Target("q_proj", "self_attn.qkv_proj", "self_attn.q_proj", "column"),
    Target("k_proj", "self_attn.qkv_proj", "self_attn.k_proj", "column"),
    Target("v_proj", "self_attn.qkv_proj", "self_attn.v_proj", "column"),
    Target("o_proj", "self_attn.o_proj", "self_attn.o_proj", "row"),
    Target("gate_proj", "mlp.gate_up_proj", "mlp.gate_proj", "column"),
    Target("up_proj", "mlp.gate_up_proj", "mlp.up_proj", "column"),
    Target("down_proj", "mlp.down_proj", "mlp.down_proj", "row"),
)}
EXPERT_TARGET_TABLE = {t.name: t for t in (
    Target(EXPERT_TARGETS[0], "mlp.experts.{e}.gate_up_proj", "mlp.experts", "column", expert=True),
    Target(EXPERT_TARGETS[1], "mlp.experts.{e}.down_proj", "mlp.experts", "row", expert=True),
)}
ALL_TARGETS = TARGETS | EXPERT_TARGET_TABLE
# the MLP targets in an MoE layer with a shared expert: its linears (Qwen2-MoE's ``mlp.shared_expert.gate_proj`` ...)
SHARED_EXPERT_TARGETS = {t.name: t for t in (
    Target("gate_proj", "mlp.shared_expert.gate_up_proj", "mlp.shared_expert.gate_proj", "column"),
    Target("up_proj", "mlp.shared_expert.gate_up_proj", "mlp.shared_expert.up_proj", "column"),
    Target("down_proj", "mlp.shared_expert.down_proj", "mlp.shared_expert.down_proj", "row"),
)}


def layer_target(config: ModelConfig, layer: int, name: str) -> Target | None:
    """Where the module target ``name`` lies in decoder layer ``layer``, or None: in a mixture of experts an MLP
    target is, where PEFT adapts one (Qwen2-MoE), a dense layer's linear or an MoE layer's shared expert's."""
    target, moe = TARGETS[name], config.family.moe
    if not target.linear.startswith("mlp."):
        return target
    if moe is not None and not moe.mlp_module_targets:
        return None
    if moe is not None and config.is_moe_layer(layer):
        target = SHARED_EXPERT_TARGETS[name] if moe.shared_expert else None
    return target if target is None else dataclasses.replace(target, hf_module=_hf_mlp_path(config, target.hf_module))


@dataclass(frozen=True)
class LoraConfig:
    """The training JSON's ``lora`` section."""

    rank: int = 8  # rank r of each adapter pair
    alpha: float = 16.0  # scaling: delta W = B @ A * alpha / rank
    dropout: float = 0.0  # dropout on the adapter input (not on expert targets)
    # HF module names (and mlp.experts.gate_up_proj / down_proj for experts) that get adapters
    targets: tuple[str, ...] = LORA_TARGETS
    # modules trained in full beside the adapters (PEFT's modules_to_save, LLaMA-Factory's additional_target):
    # embed_tokens, lm_head, norm (every norm, as PEFT matches name suffixes), model.norm (the final norm),
    # input_layernorm, post_attention_layernorm, q_norm, k_norm (Qwen3); a tied embedding trains as one table
    modules_to_save: tuple[str, ...] = ()

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def from_dict(cls, data: Any) -> LoraConfig:
        if not isinstance(data, dict):
            raise ConfigError("training config section 'lora' must be an object")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ConfigError(f"unknown keys in 'lora': {', '.join(sorted(unknown))} (keys: {', '.join(sorted(known))})")
        data = dict(data)
        targets = data.get("targets", LORA_TARGETS)
        if isinstance(targets, str) or not isinstance(targets, (list, tuple)):
            raise ConfigError(f"lora.targets must be a list of module names, got {targets!r}")
        data["targets"] = tuple(targets)
        modules = data.get("modules_to_save", ())
        if isinstance(modules, str) or not isinstance(modules, (list, tuple)):
            raise ConfigError(f"lora.modules_to_save must be a list of module names, got {modules!r}")
        data["modules_to_save"] = tuple(modules)
        config = cls(**data)
        config.validate()
        return config

    def validate(self) -> None:
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 1:
            raise ConfigError(f"lora.rank must be an integer >= 1, got {self.rank!r}")
        if not isinstance(self.alpha, (int, float)) or isinstance(self.alpha, bool) or self.alpha <= 0:
            raise ConfigError(f"lora.alpha must be a positive number, got {self.alpha!r}")
        if not isinstance(self.dropout, (int, float)) or isinstance(self.dropout, bool) or not 0 <= self.dropout < 1:
            raise ConfigError(f"lora.dropout must lie in [0, 1), got {self.dropout!r}")
        if not self.targets:
            raise ConfigError(f"lora.targets is empty: name some of {', '.join(LORA_TARGETS)}")
        for name in self.targets:
            if name not in ALL_TARGETS:
                raise ConfigError(f"lora.targets: unknown target {name!r}; targets are the HF module names "
                                  f"{', '.join(LORA_TARGETS)} and a mixture of experts' parameters "
                                  f"{', '.join(EXPERT_TARGETS)}")
        if len(set(self.targets)) != len(self.targets):
            raise ConfigError(f"lora.targets names a module twice: {list(self.targets)}")
        experts = [t for t in self.targets if t in EXPERT_TARGETS]
        if experts and self.dropout:  # PEFT's ParamWrapper refuses it too: a dropped-out input cannot be factored out
            raise ConfigError(f"lora.dropout {self.dropout} with the expert targets {', '.join(experts)}: their "
                              "adapters add to the expert weights (PEFT's target_parameters), which takes no dropout; "
                              "set lora.dropout 0")
        for name in self.modules_to_save:
            if name not in MODULES_TO_SAVE:
                raise ConfigError(f"lora.modules_to_save: {name!r} is not a module trained beside the adapters here; "
                                  f"names are PEFT's: {', '.join(MODULES_TO_SAVE)}")
        if len(set(self.modules_to_save)) != len(self.modules_to_save):
            raise ConfigError(f"lora.modules_to_save names a module twice: {list(self.modules_to_save)}")

    def to_dict(self) -> dict[str, Any]:
        """The section as written to ``llama_megatron.json`` (targets in model order, modules_to_save as given:
        PEFT's adapter config keeps them so)."""
        return {"rank": self.rank, "alpha": self.alpha, "dropout": self.dropout,
                "targets": [*self.module_targets, *self.expert_targets], "modules_to_save": list(self.modules_to_save)}

    @property
    def module_targets(self) -> list[str]:
        """PEFT's ``target_modules``: the targets that are linears (model order)."""
        return [t for t in LORA_TARGETS if t in self.targets]

    @property
    def expert_targets(self) -> list[str]:
        """PEFT's ``target_parameters``: the experts' parameters adapted (registration order)."""
        return [t for t in EXPERT_TARGETS if t in self.targets]

    def same_adapters(self, other: LoraConfig) -> bool:
        """Whether checkpoints of ``other`` hold this config's adapters and trained modules (dropout is a training
        choice only)."""
        return ((self.rank, float(self.alpha), set(self.targets), set(self.modules_to_save))
                == (other.rank, float(other.alpha), set(other.targets), set(other.modules_to_save)))

    def describe(self) -> str:
        """The adapters and trained modules in words, for log lines and refusals."""
        saved = f", modules_to_save {', '.join(self.modules_to_save)}" if self.modules_to_save else ""
        return f"rank {self.rank}, alpha {self.alpha} on {', '.join(self.targets)}{saved}"


def target_shapes(config: ModelConfig, target: str, layer: int | None = None) -> tuple[int, int]:
    """(out_features, in_features) of the HF linear ``target`` (an MLP target's in ``layer``: the shared expert's in
    an MoE layer; without ``layer``, the dense MLP's)."""
    h, ffn, expert = config.hidden_size, config.dense_intermediate_size, config.expert_intermediate_size
    if layer is not None and config.is_moe_layer(layer):
        ffn = config.shared_intermediate_size
    q_rows, kv_rows = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    return {"q_proj": (q_rows, h), "k_proj": (kv_rows, h), "v_proj": (kv_rows, h), "o_proj": (h, q_rows),
            "gate_proj": (ffn, h), "up_proj": (ffn, h), "down_proj": (h, ffn),
            EXPERT_TARGETS[0]: (2 * expert, h), EXPERT_TARGETS[1]: (h, expert)}[target]  # one expert's


def adapter_param_name(target: str, matrix: str) -> str:
    """The parameter's name on the adapter module: ``A_q_proj`` (an expert's: ``A_gate_up_proj``)."""
    return f"{matrix}_{target.rpartition('.')[2]}"


def peft_key(config: ModelConfig, layer: int, target: str, matrix: str, targets: tuple[str, ...] = ()) -> str:
    """PEFT's key for a saved adapter matrix (adapter name stripped, as ``save_pretrained`` writes it). PEFT wraps
    each adapted expert parameter of a module around the previous one (in registration order), so the key of one
    that later ones wrap has a ``base_layer`` per wrapper: ``targets`` are the run's targets."""
    wrappers, t = "", EXPERT_TARGET_TABLE.get(target)
    if t is not None:
        wrappers = ".base_layer" * sum(1 for later in EXPERT_TARGETS[EXPERT_TARGETS.index(target) + 1:]
                                       if later in targets)
        module = _hf_mlp_path(config, t.hf_module)
    else:
        module = layer_target(config, layer, target).hf_module
    return f"{PEFT_PREFIX}model.layers.{layer}.{module}{wrappers}.lora_{matrix}.weight"


def _hf_mlp_path(config: ModelConfig, path: str) -> str:
    """An ``mlp.`` path of ours under the family's HF name for the MLP (Llama 4's ``feed_forward.``)."""
    mlp = config.family.mlp_name
    return path if mlp == "mlp" else path.replace("mlp", mlp, 1)


def peft_target_parameters(config: ModelConfig, lora: LoraConfig) -> list[str] | None:
    """PEFT's ``target_parameters`` for the expert targets on the family's class (Llama 4's
    ``feed_forward.experts.gate_up_proj``), or None."""
    return [_hf_mlp_path(config, t) for t in lora.expert_targets] or None


def expert_adapter_names(layer: int, target: str, matrix: str, expert: int) -> tuple[str, ...]:
    """The table's names of one expert's slice of PEFT's tensor (``B`` of gate/up as its gate and up rows, so it splits
    over TP as the expert's weight does)."""
    stem = f"{PEFT_PREFIX}model.layers.{layer}.mlp.experts.{expert}"
    if target == EXPERT_TARGETS[0] and matrix == "B":
        return f"{stem}.gate_proj.lora_B.weight", f"{stem}.up_proj.lora_B.weight"
    return (f"{stem}.{target.rpartition('.')[2]}.lora_{matrix}.weight",)


def base_weight_name(config: ModelConfig, layer: int, target: str) -> str:
    """HF name of the weight the adapter of the (module) ``target`` in ``layer`` adds to."""
    return f"model.layers.{layer}.{layer_target(config, layer, target).hf_module}.weight"


def adapted_layers(config: ModelConfig, target: str) -> list[int]:
    """The decoder layers that have the module ``target`` (every layer, but an MLP target in an MoE model)."""
    return [i for i in range(config.num_hidden_layers) if layer_target(config, i, target) is not None]


def _specs(config: ModelConfig, lora: LoraConfig) -> list[ParamSpec]:
    specs = []
    for i in range(config.num_hidden_layers):
        experts = range(config.num_local_experts) if config.is_moe_layer(i) else ()  # Qwen's dense layers: none
        for target in (*lora.module_targets, *lora.expert_targets):
            t = EXPERT_TARGET_TABLE.get(target) or layer_target(config, i, target)
            if t is None:  # an MLP target in an MoE layer without a shared expert
                continue
            out_features, in_features = target_shapes(config, target, i)
            for matrix, shape, init in (("A", (lora.rank, in_features), "lora_a"),
                                        ("B", (out_features, lora.rank), "zeros")):
                sharded = (matrix == "B") == (t.parallel == "column")  # B of column targets, A of row targets
                split = ("column" if t.parallel == "column" else "row") if sharded else "replicated"
                for expert in experts if t.expert else (None,):
                    leaf = f"{t.linear_of(expert)}.{ADAPTER_MODULE}.{adapter_param_name(target, matrix)}"
                    names, shapes = (peft_key(config, i, target, matrix),), (shape,)
                    if t.expert:
                        names = expert_adapter_names(i, target, matrix, expert)
                        if len(names) == 2:  # B of gate/up: its gate rows and up rows, split as the weight's
                            split, shapes = "gate_up", ((out_features // 2, lora.rank),) * 2
                    specs.append(ParamSpec(f"layers.{i}.{leaf}", names, shapes, split, (i + 1,), f"{i + 1}.{leaf}",
                                           init, expert))
    return specs


def _saveable_modules(config: ModelConfig) -> list[tuple[ParamSpec, tuple[str, ...]]]:
    """The base rows a ``modules_to_save`` entry may select, each with the HF module names it is on the class: the
    vocab tables and the norms (the replicated rows that start at one). A tied table is both modules."""
    out = []
    for spec in ParamLayout(config):
        if spec.split == "vocab" or (spec.split == "replicated" and spec.init == "ones"):
            modules = tuple(name.removesuffix(".weight") for name in spec.hf_names)
            if spec.split == "vocab" and config.tie_word_embeddings:
                modules += (HEAD_MODULE,)
            out.append((spec, modules))
    return out


def _selects(name: str, module: str) -> bool:
    """PEFT's rule (``_set_trainable``): a modules_to_save name selects every module whose name ends with it."""
    return module.endswith(name)


def saved_module_specs(config: ModelConfig, lora: LoraConfig) -> list[ParamSpec]:
    """The base rows of the modules ``lora.modules_to_save`` selects, in layer order, under PEFT's keys
    (``base_model.model.`` + the HF name; a tied table under the embedding's)."""
    return [dataclasses.replace(spec, hf_names=tuple(PEFT_PREFIX + name for name in spec.hf_names))
            for spec, modules in _saveable_modules(config)
            if any(_selects(name, module) for name in lora.modules_to_save for module in modules)]


def ties_embeddings(config: ModelConfig, lora: LoraConfig) -> bool:
    """Whether the run trains a tied embedding table (PEFT's ``ensure_weight_tying``: embedding and head one)."""
    return config.tie_word_embeddings and any(spec.split == "vocab" for spec in saved_module_specs(config, lora))


def peft_modules_to_save(config: ModelConfig, lora: LoraConfig) -> list[str] | None:
    """``modules_to_save`` as PEFT writes it into ``adapter_config.json``: as given, but with a tied table trained
    PEFT (``ensure_weight_tying``) adds the embedding's full name and drops ``lm_head``, which it ties to it
    (``LoraModel._add_modules_to_save_to_tie``)."""
    names = list(lora.modules_to_save)
    if ties_embeddings(config, lora):
        if EMBED_MODULE not in names:
            names.append(EMBED_MODULE)
        if HEAD_MODULE in names:
            names.remove(HEAD_MODULE)
    return names or None


def trains_final_norm_alone(config: ModelConfig, lora: LoraConfig) -> bool:
    """Whether the only norm the run trains is the final one: the one parameter without weight decay (an optimizer
    group of its own) then sits on the last pipeline stage only."""
    norms = [spec for spec in saved_module_specs(config, lora) if spec.split == "replicated"]
    return bool(norms) and all(spec.name == "norm.weight" for spec in norms)


def adapter_layout(config: ModelConfig, lora: LoraConfig) -> ParamLayout:
    """Every adapter matrix of ``lora`` on the model of ``config`` and every module it trains in full, in layer
    order."""
    check_targets(config, lora)
    specs = sorted([*_specs(config, lora), *saved_module_specs(config, lora)], key=lambda s: s.layers[0])
    return ParamLayout(config, specs=specs)


def trained_module_names(config: ModelConfig, lora: LoraConfig) -> set[str]:
    """The module names of every parameter a LoRA run trains: its adapters and its modules to save."""
    return {spec.module_name for spec in adapter_layout(config, lora)}


def check_targets(config: ModelConfig, lora: LoraConfig) -> None:
    """Every target names something PEFT adapts on the model's class: an MLP target of a mixture of experts a dense
    MLP or a shared expert in some layer (:func:`layer_target`), an expert target an MoE layer; every module to
    save selects some module of the class."""
    modules = [module for _, names in _saveable_modules(config) for module in names]
    unmatched = [name for name in lora.modules_to_save if not any(_selects(name, m) for m in modules)]
    if unmatched:
        raise ConfigError(f"lora.modules_to_save {', '.join(unmatched)}: the {config.model_type} model has no such "
                          f"module; it has {', '.join(n for n in MODULES_TO_SAVE if any(_selects(n, m) for m in modules))}")
    missing = [t for t in lora.module_targets if not adapted_layers(config, t)]
    if missing:
        raise ConfigError(f"lora.targets {', '.join(missing)}: the {config.model_type} model has no MLP module PEFT "
                          f"adapts under these names; its targets are q_proj, k_proj, v_proj, o_proj and the experts' "
                          f"{', '.join(EXPERT_TARGETS)}")
    attention = [t for t in lora.targets if t in ("q_proj", "k_proj", "v_proj", "o_proj")]
    if config.family.latent_attention and attention:
        raise ConfigError(f"lora.targets {', '.join(attention)}: the {config.model_type} model's attention is "
                          "multi-head latent attention, whose linears (q_a_proj, q_b_proj, kv_a_proj_with_mqa, "
                          "kv_b_proj, o_proj) take no adapter yet; adapt its MLPs and experts")
    if not config.family.moe and lora.expert_targets:
        raise ConfigError(f"lora.targets {', '.join(lora.expert_targets)}: the {config.model_type} model has no "
                          f"experts; its targets are {', '.join(LORA_TARGETS)}")


def to_peft(tensors: dict[str, torch.Tensor], config: ModelConfig, lora: LoraConfig) -> dict[str, torch.Tensor]:
    """The table's tensors (full, HF names) under PEFT's keys: each adapted expert parameter's per-expert A and B
    fused as ``ParamWrapper`` holds them, A ``[E x r, in]`` (expert-major rows), B ``[out, r x E]`` (column
    ``j x E + e`` is rank j of expert e). Module targets and modules to save are passed through, a tied table under
    both of PEFT's keys (as ``ensure_weight_tying`` saves it); layers absent from ``tensors`` are skipped (a writer
    may fuse one layer at a time)."""
    out = {name: _rope_rows(name, t, config, to_file=True) for name, t in tensors.items()
           if ".mlp.experts." not in name}
    embed = f"{PEFT_PREFIX}{EMBED_MODULE}.weight"
    if config.tie_word_embeddings and embed in out:
        out[f"{PEFT_PREFIX}{HEAD_MODULE}.weight"] = out[embed]
    experts = range(config.num_local_experts)
    for i in range(config.num_hidden_layers):
        for target in lora.expert_targets:
            if expert_adapter_names(i, target, "A", 0)[0] not in tensors:
                continue
            a = [tensors[expert_adapter_names(i, target, "A", e)[0]] for e in experts]
            b = [torch.cat([tensors[n] for n in expert_adapter_names(i, target, "B", e)]) for e in experts]
            if config.family.moe.fused_expert_files:  # [E, in, out] experts: PEFT's A and B are ours transposed
                a, b = [t.t() for t in b], [t.t() for t in a]
            out[peft_key(config, i, target, "A", lora.targets)] = torch.cat(a)
            out[peft_key(config, i, target, "B", lora.targets)] = torch.stack(b, dim=-1).flatten(1)
    return out


def from_peft(state: dict[str, torch.Tensor], config: ModelConfig, lora: LoraConfig) -> dict[str, torch.Tensor]:
    """Inverse of :func:`to_peft`: PEFT's adapter tensors under the table's names (views)."""
    fused = {peft_key(config, i, t, m, lora.targets)
             for i in filter(config.is_moe_layer, range(config.num_hidden_layers))
             for t in lora.expert_targets for m in "AB"}
    if config.tie_word_embeddings:  # the head's key of a tied table is the embedding's tensor again
        fused.add(f"{PEFT_PREFIX}{HEAD_MODULE}.weight")
    out = {name: _rope_rows(name, t, config, to_file=False) for name, t in state.items() if name not in fused}
    experts = config.num_local_experts
    for i in filter(config.is_moe_layer, range(config.num_hidden_layers)):
        for target in lora.expert_targets:
            a = state[peft_key(config, i, target, "A", lora.targets)].view(experts, lora.rank, -1)
            b = state[peft_key(config, i, target, "B", lora.targets)].view(-1, lora.rank, experts)
            transposed = config.family.moe.fused_expert_files
            for e in range(experts):
                ours_a, ours_b = (b[:, :, e].t(), a[e].t()) if transposed else (a[e], b[:, :, e])
                out[expert_adapter_names(i, target, "A", e)[0]] = ours_a
                names = expert_adapter_names(i, target, "B", e)
                out.update(zip(names, ours_b.chunk(len(names))))
    return out


def _rope_rows(name: str, tensor: torch.Tensor, config: ModelConfig, to_file: bool) -> torch.Tensor:
    """The B of a q or k adapter of a family whose released q/k rows rotate interleaved pairs (Llama 4): its rows in
    the released order (``to_file``) or the table's rotate-half order, as the base weight's
    (:mod:`llama_megatron.model.released_tensors`)."""
    if not config.family.interleaved_rope(config) or not name.endswith(("q_proj.lora_B.weight", "k_proj.lora_B.weight")):
        return tensor
    return released_tensors.rope_rows(tensor, config.head_dim, to_file)


def is_adapter_parameter(module_name: str) -> bool:
    """Whether a parameter name (any form: module, canonical) names a LoRA adapter matrix."""
    return f".{ADAPTER_MODULE}." in module_name
