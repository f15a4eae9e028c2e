"""A LoRA checkpoint (any TP/PP/ZeRO) as a PEFT adapter directory, or merged into its base as HF weights.

- Adapter: ``adapter_config.json`` (``peft_type`` LORA, ``r``, ``lora_alpha``, ``lora_dropout``,
  ``target_modules``, ``modules_to_save``, ``task_type`` CAUSAL_LM, ``base_model_name_or_path``) and
  ``adapter_model.safetensors`` with PEFT's keys (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``;
  a module to save's whole weight, ``base_model.model.lm_head.weight``), TP shards merged by the adapter table's
  splits and the vocab tables cut back to the true vocab. ``peft.PeftModel.from_pretrained`` loads it onto the
  exported base. A trained tied table is written as PEFT's ``ensure_weight_tying`` writes it: under both the
  embedding's and the head's key, the config's ``modules_to_save`` rewritten as PEFT rewrites it.
- Merged: the base checkpoint the adapters record (or ``--base DIR``, fingerprint-checked) streamed tensor by
  tensor, each target weight plus ``B @ A * alpha / rank`` (PEFT's ``merge_and_unload``, in fp32) and each module to
  save's trained weight in place of the base's, written as any export
  (:func:`~llama_megatron.checkpoint.interop.hf_writer.write_hf_directory`).
"""

from __future__ import annotations

import json
import os

import torch

from llama_megatron.checkpoint.atomic import atomic_output_dir, check_output
from llama_megatron.checkpoint.interop.hf_reader import HF_CONFIG_DIR
from llama_megatron.checkpoint.interop.hf_writer import write_hf_directory
from llama_megatron.checkpoint.interop.safetensors_stream import SafetensorsShardWriter
from llama_megatron.checkpoint.lora_checkpoint import BaseRecord, find_base
from llama_megatron.checkpoint.megatron_reader import MegatronCheckpoint
from llama_megatron.config import ModelConfig
from llama_megatron.errors import CheckpointError
from llama_megatron.model.lora_layout import (
    ALL_TARGETS,
    PEFT_PREFIX,
    LoraConfig,
    adapted_layers,
    base_weight_name,
    expert_adapter_names,
    peft_key,
    peft_modules_to_save,
    peft_target_parameters,
    saved_module_specs,
    ties_embeddings,
    to_peft,
)
from llama_megatron.progress import TaskProgress

ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_STEM = "adapter_model"  # adapter_model.safetensors, the one file PEFT reads


def peft_adapter_config(config: ModelConfig, lora: LoraConfig, base_model: str | None) -> dict:
    """What ``peft.LoraConfig.save_pretrained`` writes for these adapters on the model of ``config`` (defaults for
    the rest)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank, "lora_alpha": lora.alpha,
            "lora_dropout": lora.dropout, "target_modules": lora.module_targets,
            "target_parameters": peft_target_parameters(config, lora), "bias": "none",
            "fan_in_fan_out": False, "init_lora_weights": True, "inference_mode": True, "use_rslora": False,
            "use_dora": False, "modules_to_save": peft_modules_to_save(config, lora),
            "ensure_weight_tying": ties_embeddings(config, lora), "layers_to_transform": None,
            "layers_pattern": None, "rank_pattern": {}, "alpha_pattern": {}, "base_model_name_or_path": base_model,
            "revision": None}


def write_peft_adapter(source: MegatronCheckpoint, out_dir: str, dtype: torch.dtype, base_model: str | None,
                       progress: TaskProgress | None = None) -> None:
    """Fill ``out_dir`` with the adapter files of the LoRA checkpoint ``source``, a layer at a time (the experts'
    adapters fused into PEFT's per-layer tensors, :func:`~llama_megatron.model.lora_layout.to_peft`)."""
    by_layer: dict[int, list] = {}
    for spec in source.layout:
        by_layer.setdefault(spec.layers[0], []).append(spec)
    meta = {name: torch.empty(shape, device="meta") for name, shape in source.layout.hf_shapes().items()}
    plan = [(name, tuple(t.shape), dtype) for specs in by_layer.values()
            for name, t in to_peft({n: meta[n] for s in specs for n in s.hf_names}, source.config,
                                   source.lora).items()]
    writer = SafetensorsShardWriter(out_dir, plan, max_shard_bytes=2**62, stem=ADAPTER_STEM)
    for specs in by_layer.values():
        tensors = {}
        for spec in specs:
            for name in spec.hf_names:
                tensors[name] = source.get(name)
            source.release()
            if progress:
                progress.advance(1, sum(torch.Size(s).numel() for s in spec.hf_shapes) * dtype.itemsize)
        for name, tensor in to_peft(tensors, source.config, source.lora).items():
            writer.write(name, tensor)
    writer.close()
    with open(os.path.join(out_dir, ADAPTER_CONFIG_FILE), "w", encoding="utf-8") as fh:
        json.dump(peft_adapter_config(source.config, source.lora, base_model), fh, indent=2, sort_keys=True)
        fh.write("\n")


class MergedSource:
    """A :class:`~llama_megatron.checkpoint.sources.TensorSource`: the base's HF tensors, target weights with their
    adapter merged in (fp32), the modules to save's weights the trained ones."""

    def __init__(self, base: MegatronCheckpoint, adapters: MegatronCheckpoint) -> None:
        self.base, self.adapters = base, adapters
        lora = adapters.lora
        self.scaling = lora.scaling
        config = base.config
        # each module to save's HF weight: its key in the adapter checkpoint
        self.saved = {name.removeprefix(PEFT_PREFIX): name for spec in saved_module_specs(config, lora)
                      for name in spec.hf_names}
        # each adapted HF weight: the names of its adapter's A and B (an expert's gate and up weights: B's rows for it)
        self.pairs = {base_weight_name(config, i, t): (peft_key(config, i, t, "A"), peft_key(config, i, t, "B"))
                      for t in lora.module_targets for i in adapted_layers(config, t)}
        for i in filter(base.config.is_moe_layer, range(base.config.num_hidden_layers)):
            for e in range(base.config.num_local_experts):
                for t in lora.expert_targets:
                    weights = base.layout[f"layers.{i}.{ALL_TARGETS[t].linear_of(e)}.weight"].hf_names
                    (a,), bs = expert_adapter_names(i, t, "A", e), expert_adapter_names(i, t, "B", e)
                    self.pairs.update((weight, (a, b)) for weight, b in zip(weights, bs, strict=True))

    def names(self) -> set[str]:
        return self.base.names()

    def info(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        return self.base.info(name)

    def get(self, name: str) -> torch.Tensor:
        parts = self.get_parts(name)
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def get_parts(self, name: str) -> list[torch.Tensor]:
        if name in self.saved:
            return self.adapters.get_parts(self.saved[name])
        parts = self.base.get_parts(name)
        if name not in self.pairs:
            return parts
        weight = parts[0] if len(parts) == 1 else torch.cat(parts)
        a_name, b_name = self.pairs[name]
        a, b = self.adapters.get(a_name).float(), self.adapters.get(b_name).float()
        return [weight.float() + (b @ a) * self.scaling]

    def release(self) -> None:
        self.base.release()
        self.adapters.release()


def export_lora(source: MegatronCheckpoint, output: str, *, dtype: torch.dtype | None, merge: bool,
                base_dir: str | None, base_model: str | None, assets_dir: str | None, max_shard_bytes: int,
                overwrite: bool, show_progress: bool) -> tuple[torch.dtype, str]:
    """Write the adapter directory (or, with ``merge``, the merged HF directory) of ``source``; returns the dtype
    written and a note for the report line. Everything is checked before the output is created."""
    if not merge:
        if base_dir is not None:
            raise CheckpointError("--base names the model to merge the adapters into: use it with --merge")
        out_dtype = dtype or source.dtype
        with atomic_output_dir(output, overwrite) as tmp:
            progress = TaskProgress("lora-to-peft", total=len(source.layout.specs)) if show_progress else None
            write_peft_adapter(source, tmp, out_dtype, base_model, progress)
            if progress:
                progress.close()
        return out_dtype, f"PEFT adapter, {len(source.layout.specs)} tensors from {source.source_kind}"
    if base_model is not None:
        raise CheckpointError("--base-model is recorded in a PEFT adapter's config; a merged export (--merge) has none")
    record = BaseRecord.of(source.meta, source.tag_dir)
    base_meta = find_base(record, source.tag_dir, base_dir)
    base_dir = base_dir or record.path
    check_output(output, overwrite, inputs=(base_dir,))
    base = MegatronCheckpoint(base_dir, base_meta.tag, fp32_master=dtype == torch.float32)
    out_dtype = dtype or base.stored_dtype
    if source.dtype != torch.float32:  # merge the fp32 masters of a bf16 run
        source = MegatronCheckpoint(os.path.dirname(source.tag_dir), source.meta.tag, fp32_master=True)
    if assets_dir is None and os.path.isdir(os.path.join(base_dir, HF_CONFIG_DIR)):
        assets_dir = os.path.join(base_dir, HF_CONFIG_DIR)
    with atomic_output_dir(output, overwrite) as tmp:
        progress = TaskProgress("lora-merge-to-hf", total=len(base.layout.specs)) if show_progress else None
        copied = write_hf_directory(MergedSource(base, source), base.config, tmp, out_dtype, assets_dir,
                                    max_shard_bytes, progress)
        if progress:
            progress.close()
    note = f"base {base.tag_dir} ({base.source_kind}) + adapters ({source.source_kind}) merged"
    if not any(name.startswith("tokenizer") for name in copied):
        note += "; no tokenizer files copied (pass --tokenizer DIR)"
    return out_dtype, note
