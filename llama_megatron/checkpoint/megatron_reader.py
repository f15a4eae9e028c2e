"""Our checkpoints (training or converted, any TP/PP/DP, ZeRO 0-3) as full HF-named tensors.

Per-rank tensors come from, in this order of preference:

- ZeRO-3: the fp32 partitions in the optimizer files (the model files hold empty tensors);
- ``fp32_master=True`` on a checkpoint whose module weights are not fp32 (bf16 training): the ZeRO-1/2 fp32
  master partitions, when the optimizer files have them;
- otherwise the module weights: pipeline layer files, or ``mp_rank_XX_model_states.pt['module']``; the experts of
  an expert-parallel run from their own files (checkpoint/weights.py). The fp32 masters of an expert are the pieces
  of the ranks holding it: its expert-data-parallel group, which DeepSpeed's data-parallel order lists in order.

Every ``*.pt`` file of the checkpoint is checked first (weights-only, :mod:`llama_megatron.checkpoint.safe_load`),
before any tensor is read. Files are memory-mapped and re-opened per parameter (see :meth:`release`), so a PP=1
file holding a whole TP rank never becomes resident at once. TP shards are merged as views where the layout
allows (``tp_slicing.merge_parts``), the vocab padding stripped.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from llama_megatron.checkpoint.directory import CheckpointMeta, read_meta
from llama_megatron.checkpoint.manifest import verify_tag
from llama_megatron.checkpoint.safe_load import load_state_file, verify_checkpoint_dir
from llama_megatron.checkpoint.weights import (
    expert_file,
    is_pipeline_checkpoint,
    layer_file,
    model_states_file,
)
from llama_megatron.checkpoint.zero_fp32 import (
    Zero3Partitions,
    Zero12Partitions,
    has_optimizer_files,
    zero3_model_file,
)
from llama_megatron.config import ModelConfig
from llama_megatron.errors import CheckpointError, ConfigError
from llama_megatron.model.lora_layout import adapter_layout, is_adapter_parameter
from llama_megatron.model.param_layout import ParamLayout, ParamSpec
from llama_megatron.model.tp_slicing import merge_parts, shard_shape
from llama_megatron.parallel.zero3 import copy_into, full_shape


class MegatronCheckpoint:
    """A :class:`~llama_megatron.checkpoint.sources.TensorSource` over ``load_dir`` (tag: ``latest`` or named)."""

    def __init__(self, load_dir: str, tag: str | None = None, fp32_master: bool = False,
                 checksum: bool = True) -> None:
        """Reads the tag's metadata and checks its files against the manifest (sizes; checksums too unless
        ``checksum`` is False: the training start verifies those spread over its ranks) before any tensor."""
        self.meta: CheckpointMeta = read_meta(load_dir, tag)
        self.tag_dir = os.path.join(load_dir, self.meta.tag)
        self.verified = verify_tag(self.tag_dir, checksum=checksum)
        verify_checkpoint_dir(self.tag_dir)
        try:
            self.config = ModelConfig.from_dict(self.meta.model)
        except ConfigError as exc:
            raise CheckpointError(f"{self.tag_dir}: model config in llama_megatron.json is invalid: {exc}") from None
        self.tp, self.pp, self.dp = self.meta.tensor, self.meta.pipeline, self.meta.zero_partitions
        self.padded_vocab_size = self.meta.padded_vocab_size
        if self.padded_vocab_size < self.config.vocab_size or self.padded_vocab_size % self.tp:
            raise CheckpointError(f"{self.tag_dir}: padded_vocab_size {self.padded_vocab_size} does not fit vocab "
                                  f"{self.config.vocab_size} split over TP {self.tp}")
        self.lora = self.meta.adapters()  # an adapter-only checkpoint: its tensors are the LoRA adapters
        self.layout = adapter_layout(self.config, self.lora) if self.lora else ParamLayout(self.config)
        self._hf_shapes = self.layout.hf_shapes()
        self._files: dict[str, dict] = {}
        self._merged: tuple[str, dict[str, list[torch.Tensor]]] | None = None
        self._zero3 = self.meta.zero_stage >= 3
        self._pipeline = self.pp > 1 or is_pipeline_checkpoint(self.tag_dir)
        self._masters: list[Zero12Partitions] | None = None
        self._zero3_ranks: dict[int, Zero3Partitions] = {}
        self.stored_dtype = self._stored_dtype()
        if fp32_master and not self._zero3 and self.stored_dtype != torch.float32 and has_optimizer_files(self.tag_dir):
            self._masters = [Zero12Partitions(self.tag_dir, r, self.tp, self.pp, self.dp) for r in range(self.tp)]
        from_masters = self._zero3 or self._masters is not None
        self.dtype = torch.float32 if from_masters else self.stored_dtype
        self.source_kind = ("ZeRO-3 fp32 partitions" if self._zero3 else
                            "fp32 master partitions" if self._masters is not None else
                            f"{str(self.stored_dtype).removeprefix('torch.')} module weights")

    def _file(self, path: str) -> dict:
        if path not in self._files:
            self._files[path] = load_state_file(path)
        return self._files[path]

    def _stored_dtype(self) -> torch.dtype:
        """dtype of the module weights (ZeRO-3 model files keep empty tensors of the training dtype)."""
        first = self.layout.specs[0]
        if self._zero3:
            module = load_state_file(zero3_model_file(self.tag_dir, 0, 0)).get("module") or {}
            tensor = module.get(first.module_name)
            if tensor is None:
                raise CheckpointError(f"{self.tag_dir}: ZeRO-3 model file lacks {first.module_name}")
            return tensor.dtype
        dtype = self._module_tensor(first, 0).dtype
        self.release()
        return dtype

    def _module_tensor(self, spec: ParamSpec, rank: int) -> torch.Tensor:
        if spec.expert is not None and self.meta.expert > 1:
            path = expert_file(self.tag_dir, spec.layers[0], spec.expert, rank)
            state, key = self._file(path), spec.layer_key
        elif self._pipeline:
            path = layer_file(self.tag_dir, spec.layers[0], rank)
            state, key = self._file(path), spec.layer_key
        else:
            path = model_states_file(self.tag_dir, rank)
            state, key = self._file(path).get("module") or {}, spec.module_name
        if key not in state:
            raise CheckpointError(f"{path}: no tensor {key!r} ({spec.name}, TP rank {rank})")
        tensor = state[key]
        if tensor.numel() == 0:
            raise CheckpointError(f"{path}: {key!r} is empty (ZeRO-3 partitioned) but llama_megatron.json says "
                                  f"ZeRO stage {self.meta.zero_stage}")
        return tensor

    def read_rank(self, spec: ParamSpec, rank: int) -> torch.Tensor:
        """TP rank ``rank``'s tensor for ``spec``, shape-checked."""
        want = shard_shape(spec, self.config, self.tp, self.padded_vocab_size)
        name = spec.module_name
        if self._zero3:
            if rank not in self._zero3_ranks:
                self._zero3_ranks[rank] = Zero3Partitions(self.tag_dir, rank, self.dp)
            tensor = self._zero3_ranks[rank].read(name)
        elif self._masters is not None:
            tensor = self._masters[rank].read(name, want)
        else:
            tensor = self._module_tensor(spec, rank)
        if tuple(tensor.shape) != want:
            raise CheckpointError(f"{self.tag_dir}: {name} (TP rank {rank}) has shape {tuple(tensor.shape)}, the "
                                  f"model config in llama_megatron.json implies {want}")
        return tensor

    def names(self) -> set[str]:
        return set(self._hf_shapes)

    def info(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        return self._hf_shapes[name], self.dtype

    def get(self, name: str) -> torch.Tensor:
        parts = self.get_parts(name)
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def get_parts(self, name: str) -> list[torch.Tensor]:
        try:
            spec = self.layout.for_hf(name)
        except KeyError:
            raise CheckpointError(f"{self.tag_dir}: the model has no tensor {name}") from None
        if self._merged is None or self._merged[0] != spec.name:
            self._merged = None
            shards = [self.read_rank(spec, rank) for rank in range(self.tp)]
            self._merged = (spec.name, merge_parts(spec, shards, self.config))
        return self._merged[1][name]

    def release(self) -> None:
        self._merged = None
        self._files.clear()
        for part in self._zero3_ranks.values():
            part.release()
        for part in self._masters or []:
            part.release()


@torch.no_grad()
def load_model_weights(model: nn.Module, load_dir: str, tag: str | None, tp_rank: int) -> None:
    """Fill the parameters of ``model`` (plain or pipeline form, any PP) that the checkpoint holds with TP rank
    ``tp_rank``'s tensors of a checkpoint with the same TP degree: the fine-tuning start, before DeepSpeed wraps
    the model. A full checkpoint fills the base weights, a LoRA checkpoint the adapters and the modules it trained
    in full. ZeRO-3 and bf16 checkpoints give their fp32 master weights."""
    source = MegatronCheckpoint(load_dir, tag, fp32_master=True, checksum=False)
    held = {spec.module_name for spec in source.layout}
    for name, param in model.named_parameters():
        if (name not in held) if source.lora is not None else is_adapter_parameter(name):
            continue
        tensor = source.read_rank(source.layout.for_module(name), tp_rank)
        if tuple(tensor.shape) != full_shape(param):
            raise CheckpointError(f"{source.tag_dir}: {name} has shape {tuple(tensor.shape)}, the model expects "
                                  f"{full_shape(param)}")
        copy_into(param, tensor)  # a ZeRO-3 partitioned parameter takes its slice only
        source.release()
