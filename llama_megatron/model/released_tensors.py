"""How a family's released files hold the parameter table's HF tensors, where the two differ (Llama 4, DeepSeek-V3).

The table (:mod:`llama_megatron.model.param_layout`) names one tensor per HF linear, in the layout our layers
compute with. Llama 4's files (and ``Llama4ForCausalLM``'s state dict) differ in two ways, both undone here at the
boundary, so that conversion, export and the tests' in-memory HF state dicts all see the table's tensors:

- q and k rotate interleaved pairs: HF's Llama 4 applies RoPE as a complex product on ``(x[2j], x[2j + 1])``. The
  table holds each head's q and k rows (and biases) permuted to rotate-half order ``(x[j], x[j + d/2])``, which
  our RoPE kernels (and Liger's) rotate with the same frequencies. One permutation of both q and k changes neither
  the products q.k, nor the L2 norm of a head, nor the temperature scaling: the model computes the same function,
  as transformers' own conversion of Meta's LLaMA 1-3 weights permutes them the same way.
- Each MoE layer's experts are two 3-D tensors, ``feed_forward.experts.gate_up_proj`` [E, h, 2 x ffn] (``x @ W``:
  the gate's columns, then up's) and ``feed_forward.experts.down_proj`` [E, ffn, h]; the table has each expert's
  ``gate_proj`` and ``up_proj`` [ffn, h] and ``down_proj`` [h, ffn], read as transposed slices (views).

DeepSeek-V3's (``rope_interleave``) rotate interleaved pairs too, in the rotated part of each head only: the last
``qk_rope_head_dim`` rows of each q head (``q_b_proj``, or ``q_proj``), and the last rows of ``kv_a_proj_with_mqa``
(after the ``kv_lora_rank`` latent), the key part every head shares; those rows are permuted alike.

A released multimodal checkpoint (``Llama4ForConditionalGeneration``) holds the text model under
``language_model.``: :func:`text_model_names` finds it and what else the files hold.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from llama_megatron.config import ModelConfig
from llama_megatron.families import FAMILIES

Getter = Callable[[str], torch.Tensor]


def differs(config: ModelConfig) -> bool:
    """Whether the family's files hold any tensor otherwise than the table does."""
    moe = config.family.moe
    return config.family.interleaved_rope(config) or (moe is not None and moe.fused_expert_files)


def rotate_half_order(head_dim: int) -> torch.Tensor:
    """Row ``j`` of a rotate-half head is row ``order[j]`` of the interleaved head: the pair members 2j, 2j + 1 go
    to j and j + d/2."""
    return torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])


def _permuted_rows(tensor: torch.Tensor, head_dim: int, order: torch.Tensor) -> torch.Tensor:
    heads = tensor.shape[0] // head_dim
    return tensor.reshape(heads, head_dim, *tensor.shape[1:])[:, order].reshape(tensor.shape)


def rope_rows(tensor: torch.Tensor, head_dim: int, to_file: bool, width: int | None = None,
              offset: int = 0) -> torch.Tensor:
    """A q or k tensor's rows from the released interleaved order to the table's rotate-half order, or back
    (``to_file``): in each head of ``width`` rows (default ``head_dim``), the ``head_dim`` rotated rows from
    ``offset`` on."""
    order = rotate_half_order(head_dim)
    order = torch.argsort(order) if to_file else order
    width = head_dim if width is None else width
    index = torch.arange(width)
    index[offset:offset + head_dim] = offset + order
    return _permuted_rows(tensor, width, index)


@dataclass(frozen=True)
class _FileNames:
    """Which table tensors the files hold otherwise: built once per model shape (a conversion asks per tensor)."""

    # the table's q and k tensors (weights and biases) of every layer -> (rows per head, offset of the rotated ones)
    rope_rows: dict[str, tuple[int, int]]
    experts: dict[str, tuple[str, int, str]]  # table name -> (file name, expert, part) of every routed expert
    parts_of_file: dict[str, tuple[str, ...]]  # fused file name -> its table tensors, by expert then gate, up, down


@functools.lru_cache(maxsize=8)
def _names_for(model_type: str, layers: int, qkv_bias: bool, experts: int, moe_layers: tuple[int, ...],
               interleaved: bool, head_dim: int, latent: tuple[int | None, int, int] | None) -> _FileNames:
    """``latent``: multi-head latent attention's (q_lora_rank, kv_lora_rank, qk_nope_head_dim)."""
    family = FAMILIES[model_type]
    rope_rows: dict[str, tuple[int, int]] = {}
    if interleaved and latent is None:
        kinds = ("weight", "bias") if qkv_bias else ("weight",)
        rope_rows = {f"model.layers.{i}.self_attn.{p}_proj.{kind}": (head_dim, 0) for i in range(layers)
                     for p in "qk" for kind in kinds}
    elif interleaved:
        q_lora_rank, kv_lora_rank, nope = latent
        q = "q_b_proj" if q_lora_rank is not None else "q_proj"
        for i in range(layers):
            rope_rows[f"model.layers.{i}.self_attn.{q}.weight"] = (nope + head_dim, nope)
            for kind in ("weight", "bias") if qkv_bias else ("weight",):
                rope_rows[f"model.layers.{i}.self_attn.kv_a_proj_with_mqa.{kind}"] = (kv_lora_rank + head_dim,
                                                                                      kv_lora_rank)
    fused: dict[str, tuple[str, int, str]] = {}
    parts_of_file: dict[str, list[str]] = {}
    moe = family.moe
    if moe is not None and moe.fused_expert_files:
        gate, up, down = moe.leaves
        for i in moe_layers:
            prefix = f"model.layers.{i}.{moe.block}.experts"
            for e in range(experts):
                for leaf, file, part in ((gate, "gate_up_proj", "gate"), (up, "gate_up_proj", "up"),
                                         (down, "down_proj", "down")):
                    fused[f"{prefix}.{e}.{leaf}.weight"] = (f"{prefix}.{file}", e, part)
                    parts_of_file.setdefault(f"{prefix}.{file}", []).append(f"{prefix}.{e}.{leaf}.weight")
    return _FileNames(rope_rows, fused, {file: tuple(tables) for file, tables in parts_of_file.items()})


def _file_names(config: ModelConfig) -> _FileNames:
    moe_layers = tuple(filter(config.is_moe_layer, range(config.num_hidden_layers))) if config.family.moe else ()
    latent = ((config.q_lora_rank, config.kv_lora_rank, config.qk_nope_head_dim) if config.family.latent_attention
              else None)
    # MLA's kv_a_proj bias: attention_bias (its q/k/v have no fused bias row of their own)
    bias = config.attention_bias if latent else config.qkv_bias
    return _names_for(config.model_type, config.num_hidden_layers, bias, config.num_local_experts or 0,
                      moe_layers, config.family.interleaved_rope(config), config.head_dim, latent)


def file_name_of(name: str, config: ModelConfig) -> str:
    """The file tensor that the table's tensor ``name`` is read from."""
    fused = _file_names(config).experts.get(name)
    return name if fused is None else fused[0]


def table_tensor(name: str, get_file: Getter, config: ModelConfig) -> torch.Tensor:
    """The table's tensor ``name`` from the file tensors ``get_file`` hands out (views where no permutation)."""
    names = _file_names(config)
    fused = names.experts.get(name)
    if fused is not None:
        file, e, part = fused
        ffn = config.expert_intermediate_size
        tensor = get_file(file)[e]
        return {"gate": lambda: tensor[:, :ffn].t(), "up": lambda: tensor[:, ffn:].t(),
                "down": lambda: tensor.t()}[part]()
    tensor = get_file(name)
    rows = names.rope_rows.get(name)
    return tensor if rows is None else rope_rows(tensor, config.head_dim, False, *rows)


def file_shapes(table_shapes: dict[str, tuple[int, ...]], config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The file's tensors and shapes for the table's ``table_shapes`` (in its order)."""
    experts = _file_names(config).experts
    out: dict[str, tuple[int, ...]] = {}
    h, ffn, count = config.hidden_size, config.expert_intermediate_size, config.num_local_experts
    for name, shape in table_shapes.items():
        fused = experts.get(name)
        if fused is None:
            out[name] = shape
        elif fused[0] not in out:
            out[fused[0]] = (count, h, 2 * ffn) if fused[2] != "down" else (count, ffn, h)
    return out


def file_tensor(name: str, get_table: Getter, config: ModelConfig) -> torch.Tensor:
    """The file's tensor ``name`` assembled from the table's tensors (the inverse of :func:`table_tensor`)."""
    names = _file_names(config)
    rows = names.rope_rows.get(name)
    if rows is not None:
        return rope_rows(get_table(name), config.head_dim, True, *rows)
    parts = names.parts_of_file.get(name)
    if parts is None:
        return get_table(name)
    if name.endswith("down_proj"):
        return torch.stack([get_table(table).t() for table in parts])
    return torch.stack([torch.cat([get_table(gate).t(), get_table(up).t()], dim=1)
                        for gate, up in zip(parts[0::2], parts[1::2])])


def table_tensors(state: dict, config: ModelConfig, names_only: bool = False) -> dict:
    """A transformers model's state dict (or its gradients) under the table's names: every tensor the table can
    read from what ``state`` holds (a tied model's state lacks ``lm_head.weight``); ``names_only``: the names, each
    mapped to None."""
    experts = _file_names(config).experts
    consumed = {file for file, _, _ in experts.values()}
    names = [name for name in state if name not in consumed]
    names += [name for name, (file, _, _) in experts.items() if file in state]
    if names_only:
        return dict.fromkeys(names)
    return {name: table_tensor(name, state.__getitem__, config) for name in names}


def text_model_names(names: set[str], config: ModelConfig) -> tuple[str, set[str]]:
    """(prefix of the text model's tensors, the other tensors) in a file holding ``names``: a multimodal release
    keeps the text model under the family's prefix (``language_model.``) beside a vision tower."""
    prefix = config.family.multimodal_prefix
    if prefix and any(name.startswith(prefix) for name in names):
        return prefix, {name for name in names if not name.startswith(prefix)}
    return "", set()
