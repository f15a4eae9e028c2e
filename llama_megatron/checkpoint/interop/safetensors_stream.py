"""Sharded ``model.safetensors`` written tensor by tensor, in Hugging Face's file layout.

Every name, shape and dtype is known before the first byte is written (they follow from the model config), so each
shard's header can be written first and tensors streamed in after it: memory never holds more than the tensor
being written. Shards are filled in order up to ``max_shard_bytes`` (a tensor larger than that gets a shard of its
own), named like ``save_pretrained`` names them (``model.safetensors`` alone, or ``model-0000i-of-0000n`` plus
``model.safetensors.index.json``).
"""

from __future__ import annotations

import json
import os
import struct

import torch

from llama_megatron.checkpoint.torch_stream import tensor_chunks

SAFE_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}

PlanEntry = tuple[str, tuple[int, ...], torch.dtype]


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return torch.Size(shape).numel() * dtype.itemsize


def plan_shards(plan: list[PlanEntry], max_shard_bytes: int) -> list[list[PlanEntry]]:
    shards: list[list[PlanEntry]] = [[]]
    size = 0
    for entry in plan:
        nbytes = _nbytes(entry[1], entry[2])
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += nbytes
    return shards


def _header(entries: list[PlanEntry]) -> bytes:
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, dtype in entries:
        end = offset + _nbytes(shape, dtype)
        header[name] = {"dtype": SAFE_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, end]}
        offset = end
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned, as safetensors writes it
    return struct.pack("<Q", len(raw)) + raw


class SafetensorsShardWriter:
    """Write the tensors of ``plan`` (in plan order) into ``out_dir``; ``close()`` writes the index."""

    def __init__(self, out_dir: str, plan: list[PlanEntry], max_shard_bytes: int, stem: str = "model") -> None:
        self.out_dir = out_dir
        self.stem = stem  # "adapter_model" for PEFT adapters
        self.shards = plan_shards(plan, max_shard_bytes)
        count = len(self.shards)
        self.files = ([f"{stem}.safetensors"] if count == 1 else
                      [f"{stem}-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)])
        self._order = [(shard, entry) for shard, entries in enumerate(self.shards) for entry in entries]
        self._next = 0
        self._fh = None
        self._open_shard = -1

    def write(self, name: str, *parts: torch.Tensor) -> None:
        """Write ``name`` as the concatenation (along dim 0) of ``parts``, cast to the planned dtype."""
        if self._next >= len(self._order):
            raise RuntimeError(f"safetensors writer: unexpected tensor {name}")
        shard, (want, shape, dtype) = self._order[self._next]
        if name != want:
            raise RuntimeError(f"safetensors writer: got {name}, expected {want} next")
        rows = sum(part.shape[0] for part in parts)
        if any(tuple(part.shape[1:]) != tuple(shape[1:]) for part in parts) or rows != shape[0]:
            got = [tuple(part.shape) for part in parts]
            raise RuntimeError(f"safetensors writer: {name} parts {got} do not make the planned shape {shape}")
        if shard != self._open_shard:
            self._close_file()
            self._fh = open(os.path.join(self.out_dir, self.files[shard]), "wb")  # noqa: SIM115
            self._fh.write(_header(self.shards[shard]))
            self._open_shard = shard
        for part in parts:
            for data in tensor_chunks(part, dtype):
                self._fh.write(data)
        self._next += 1

    def _close_file(self) -> None:
        if self._fh is not None:
            self._fh.flush()
            os.fsync(self._fh.fileno())
            self._fh.close()
            self._fh = None

    def close(self) -> None:
        self._close_file()
        if self._next != len(self._order):
            raise RuntimeError(f"safetensors writer: {len(self._order) - self._next} planned tensors never written")
        if len(self.files) > 1:
            weight_map = {name: self.files[shard] for shard, (name, _, _) in self._order}
            total = sum(_nbytes(shape, dtype) for _, (_, shape, dtype) in self._order)
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            with open(os.path.join(self.out_dir, f"{self.stem}.safetensors.index.json"), "w", encoding="utf-8") as fh:
                json.dump(index, fh, indent=2)
                fh.write("\n")
