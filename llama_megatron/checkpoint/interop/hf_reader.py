"""Read a Hugging Face LLaMA directory tensor by tensor; copy its config and tokenizer files.

Weights: ``model.safetensors`` or ``pytorch_model.bin``, each alone or sharded with its ``*.index.json``.
safetensors files are opened with ``safe_open`` (memory-mapped; a tensor's pages are read when used), legacy
``.bin`` files with :func:`~llama_megatron.checkpoint.safe_load.load_state_file` (weights-only, memory-mapped).
Handles are closed on :meth:`release`.
"""

from __future__ import annotations

import json
import os
import shutil

import torch
from safetensors import safe_open

from llama_megatron.checkpoint.safe_load import load_state_file
from llama_megatron.config import ModelConfig
from llama_megatron.data.tokenizer import TOKENIZER_FILES
from llama_megatron.errors import CheckpointError
from llama_megatron.model import released_tensors

_SAFE_TO_TORCH = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}

HF_ASSET_FILES = ("config.json", "generation_config.json", *TOKENIZER_FILES)
HF_CONFIG_DIR = "hf_config"  # where converted checkpoints keep the HF config and tokenizer files


def _weight_files(hf_dir: str) -> tuple[str, dict[str, str] | None, list[str]]:
    """(kind, weight_map or None, files) for the directory's weights."""
    for kind, single, index in (("safetensors", "model.safetensors", "model.safetensors.index.json"),
                                ("bin", "pytorch_model.bin", "pytorch_model.bin.index.json")):
        index_path = os.path.join(hf_dir, index)
        if os.path.isfile(index_path):
            try:
                with open(index_path, encoding="utf-8") as fh:
                    weight_map = json.load(fh)["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise CheckpointError(f"{index_path} is not a valid weight index: {exc}") from None
            if not isinstance(weight_map, dict) or not all(
                    isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
                raise CheckpointError(f"{index_path} is not a valid weight index: its weight_map is not an object "
                                      "of tensor names to file names")
            files = sorted(set(weight_map.values()))
            for name in files:
                _check_inside(hf_dir, name, index)
                if not os.path.isfile(os.path.join(hf_dir, name)):
                    raise CheckpointError(f"{hf_dir}: shard {name} listed in {index} is missing")
            return kind, weight_map, files
        if os.path.isfile(os.path.join(hf_dir, single)):
            return kind, None, [single]
    raise CheckpointError(f"no weights in {hf_dir}: expected model.safetensors, pytorch_model.bin or a sharded "
                          "index (model.safetensors.index.json / pytorch_model.bin.index.json)")


def _check_inside(hf_dir: str, name: str, index: str) -> None:
    """A shard an index names is a file of the model directory: an untrusted index must not make the reader open
    ``../outside.safetensors`` or ``/etc/...``, also not through a symlink."""
    root = os.path.realpath(hf_dir)
    path = os.path.realpath(os.path.join(hf_dir, name))
    if os.path.isabs(name) or not path.startswith(root + os.sep):
        raise CheckpointError(f"{hf_dir}: {index} names shard {name!r}, which is not a file inside the model "
                              "directory")


class HFCheckpoint:
    """A :class:`~llama_megatron.checkpoint.sources.TensorSource` over an HF model directory."""

    def __init__(self, hf_dir: str) -> None:
        self.hf_dir = hf_dir
        self.kind, weight_map, self.files = _weight_files(hf_dir)
        self._open: dict[str, object] = {}
        if weight_map is not None:
            self._where = dict(weight_map)
        else:
            self._where = {name: self.files[0] for name in self._keys(self.files[0])}
            self.release()

    def _path(self, file: str) -> str:
        return os.path.join(self.hf_dir, file)

    def _handle(self, file: str):
        if file not in self._open:
            path = self._path(file)
            if self.kind == "safetensors":
                try:
                    self._open[file] = safe_open(path, framework="pt")
                except Exception as exc:  # safetensors raises its own error type for bad headers/sizes
                    raise CheckpointError(f"cannot read {path} (truncated or not safetensors): {exc}") from None
            else:
                self._open[file] = load_state_file(path)
        return self._open[file]

    def _keys(self, file: str) -> list[str]:
        handle = self._handle(file)
        return list(handle.keys())

    def names(self) -> set[str]:
        return set(self._where)

    def _file_of(self, name: str) -> str:
        if name not in self._where:
            raise CheckpointError(f"{self.hf_dir}: no tensor {name}")
        return self._where[name]

    def info(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        file = self._file_of(name)
        handle = self._handle(file)
        if self.kind == "safetensors":
            try:
                view = handle.get_slice(name)
            except Exception:
                raise CheckpointError(f"{self._path(file)}: index lists {name} but the file lacks it") from None
            dtype = view.get_dtype()
            if dtype not in _SAFE_TO_TORCH:
                raise CheckpointError(f"{self._path(file)}: tensor {name} has dtype {dtype}, which conversion does not "
                                      f"read (it reads {', '.join(_SAFE_TO_TORCH)}): dequantize the model first")
            return tuple(view.get_shape()), _SAFE_TO_TORCH[dtype]
        if name not in handle:
            raise CheckpointError(f"{self._path(file)}: index lists {name} but the file lacks it")
        return tuple(handle[name].shape), handle[name].dtype

    def get(self, name: str) -> torch.Tensor:
        if self.kind == "safetensors":
            self.info(name)  # its dtype one we read (header only), before any data
        file = self._file_of(name)
        handle = self._handle(file)
        try:
            return handle.get_tensor(name) if self.kind == "safetensors" else handle[name]
        except Exception as exc:
            raise CheckpointError(f"cannot read {name} from {self._path(file)}: {exc}") from None

    def get_parts(self, name: str) -> list[torch.Tensor]:
        return [self.get(name)]

    def release(self) -> None:
        for handle in self._open.values():
            if hasattr(handle, "__exit__"):
                handle.__exit__(None, None, None)
        self._open.clear()


class ReleasedFiles:
    """A family's released files (an :class:`HFCheckpoint`) under the parameter table's names, where the two differ
    (:mod:`llama_megatron.model.released_tensors`: Llama 4's interleaved q/k rows and fused experts) or the text model
    sits in a multimodal checkpoint (under ``language_model.``, beside a vision tower this source leaves out)."""

    def __init__(self, files: HFCheckpoint, config: ModelConfig) -> None:
        self.files, self.config = files, config
        self.prefix, self.left_out = released_tensors.text_model_names(files.names(), config)
        text = {name[len(self.prefix):] for name in files.names() if name.startswith(self.prefix)}
        self._names = set(released_tensors.table_tensors(dict.fromkeys(text), config, names_only=True))

    @property
    def hf_dir(self) -> str:
        return self.files.hf_dir

    def names(self) -> set[str]:
        return set(self._names)

    def _file(self, name: str) -> torch.Tensor:
        return self.files.get(self.prefix + name)

    def info(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        file = released_tensors.file_name_of(name, self.config)
        shape, dtype = self.files.info(self.prefix + file)
        if file != name:  # one expert's linear of a fused [E, ...] tensor
            return tuple(released_tensors.table_tensor(name, lambda _: torch.empty(shape, device="meta"),
                                                       self.config).shape), dtype
        return shape, dtype

    def get(self, name: str) -> torch.Tensor:
        if name not in self._names:
            raise CheckpointError(f"{self.files.hf_dir}: no tensor {name}")
        return released_tensors.table_tensor(name, self._file, self.config)

    def get_parts(self, name: str) -> list[torch.Tensor]:
        return [self.get(name)]

    def release(self) -> None:
        self.files.release()


def open_hf_weights(hf_dir: str, config: ModelConfig) -> HFCheckpoint | ReleasedFiles:
    """The tensor source of an HF directory of ``config``'s family, under the table's names."""
    files = HFCheckpoint(hf_dir)
    if released_tensors.differs(config) or config.family.multimodal_prefix:
        return ReleasedFiles(files, config)
    return files


def copy_assets(src_dir: str, dst_dir: str, names: tuple[str, ...] = HF_ASSET_FILES) -> list[str]:
    """Copy the named files that exist in ``src_dir``; returns what was copied."""
    copied = []
    os.makedirs(dst_dir, exist_ok=True)
    for name in names:
        path = os.path.join(src_dir, name)
        if os.path.isfile(path):
            shutil.copyfile(path, os.path.join(dst_dir, name))
            copied.append(name)
    return copied
