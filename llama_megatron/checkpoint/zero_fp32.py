"""fp32 master weights out of DeepSpeed ZeRO optimizer files, one parameter at a time.

Files are read by :func:`~llama_megatron.checkpoint.safe_load.load_state_file` (weights-only, DeepSpeed's few
classes allow-listed) and memory-mapped, so the Adam moments stored beside the weights are never read. Layouts (as
DeepSpeed's ``zero_to_fp32.py`` reconstructs them):

- ZeRO-3: every parameter of param group g is flattened, padded to a multiple of DP and split evenly; DP rank r's
  ``fp32_flat_groups[g]`` holds its ``ceil(numel / DP)`` elements of each parameter, in ``param_shapes[g]`` order
  (``param_shapes`` is in the ``zero_pp_rank_*_model_states.pt`` files).
- ZeRO-1/2 and the bf16 optimizer: each group's flat buffer is cut into DP contiguous partitions;
  ``param_slice_mappings[g][name]`` gives (start, numel) of the parameter's piece inside rank r's
  ``single_partition_of_fp32_groups[g]``; the pieces in DP order make the flattened parameter.
"""

from __future__ import annotations

import math
import os

import torch

from llama_megatron.checkpoint.safe_load import load_state_file
from llama_megatron.errors import CheckpointError


def optim_file(ckpt_dir: str, dp_rank: int, mp_rank: int) -> str:
    """``zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt`` (``bf16_`` prefixed for bf16 optimizers)."""
    name = f"zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_optim_states.pt"
    for candidate in (name, "bf16_" + name):
        path = os.path.join(ckpt_dir, candidate)
        if os.path.isfile(path):
            return path
    raise CheckpointError(f"checkpoint file missing: {os.path.join(ckpt_dir, name)} (DP rank {dp_rank} of the "
                          "ZeRO partitions)")


def has_optimizer_files(ckpt_dir: str) -> bool:
    """Whether DeepSpeed saved optimizer partitions here (weights-only and converted checkpoints have none)."""
    return any(os.path.isfile(os.path.join(ckpt_dir, prefix + "zero_pp_rank_0_mp_rank_00_optim_states.pt"))
               for prefix in ("", "bf16_"))


def zero3_model_file(ckpt_dir: str, dp_rank: int, tp_rank: int) -> str:
    return os.path.join(ckpt_dir, f"zero_pp_rank_{dp_rank}_mp_rank_{tp_rank:02d}_model_states.pt")


class _FileCache:
    def __init__(self) -> None:
        self._files: dict[str, dict] = {}

    def get(self, path: str) -> dict:
        if path not in self._files:
            self._files[path] = load_state_file(path)
        return self._files[path]

    def release(self) -> None:
        self._files.clear()


class Zero3Partitions:
    """One TP rank's fp32 parameters of a ZeRO-3 checkpoint saved with ``dp`` data-parallel ranks."""

    def __init__(self, ckpt_dir: str, tp_rank: int, dp: int) -> None:
        self.ckpt_dir, self.tp_rank, self.dp = ckpt_dir, tp_rank, dp
        self._files = _FileCache()
        model_state = self._files.get(zero3_model_file(ckpt_dir, 0, tp_rank))
        groups = model_state.get("param_shapes")
        optim = self._files.get(optim_file(ckpt_dir, 0, tp_rank))["optimizer_state_dict"]
        flat = optim.get("fp32_flat_groups")
        if not groups or flat is None or len(groups) != len(flat):
            raise CheckpointError(f"{ckpt_dir}: not a ZeRO-3 checkpoint (no param_shapes / fp32_flat_groups)")
        if optim.get("partition_count") != dp:
            raise CheckpointError(f"{ckpt_dir}: ZeRO-3 partitions were saved over {optim.get('partition_count')} "
                                  f"ranks, llama_megatron.json says data_parallel x context = {dp}")
        self.index: dict[str, tuple[int, int, int, torch.Size]] = {}
        for g, (shapes, flat_group) in enumerate(zip(groups, flat)):
            offset = 0
            for name, shape in shapes.items():
                numel = math.prod(shape)
                self.index[name] = (g, offset, numel, torch.Size(shape))
                offset += math.ceil(numel / dp)
            if offset != flat_group.numel():
                raise CheckpointError(f"{ckpt_dir}: ZeRO-3 group {g} holds {flat_group.numel()} elements per rank, "
                                      f"its parameters need {offset}")
        self._files.release()

    def read(self, name: str) -> torch.Tensor:
        if name not in self.index:
            raise CheckpointError(f"{self.ckpt_dir}: no ZeRO-3 partition of {name} for TP rank {self.tp_rank}")
        g, offset, numel, shape = self.index[name]
        per_rank = math.ceil(numel / self.dp)
        pieces = []
        for dp_rank in range(self.dp):
            flat = self._files.get(optim_file(self.ckpt_dir, dp_rank, self.tp_rank))["optimizer_state_dict"]
            group = flat["fp32_flat_groups"][g]
            if group.numel() < offset + per_rank:
                raise CheckpointError(f"{self.ckpt_dir}: DP rank {dp_rank}'s partition is too short")
            pieces.append(group[offset:offset + per_rank])
        return torch.cat(pieces)[:numel].view(shape)

    def release(self) -> None:
        self._files.release()


class Zero12Partitions:
    """fp32 masters of ZeRO-1/2 (or bf16-optimizer) checkpoints for one TP rank, any PP and DP."""

    def __init__(self, ckpt_dir: str, tp_rank: int, tp: int, pp: int, dp: int) -> None:
        self.ckpt_dir, self.tp_rank = ckpt_dir, tp_rank
        self._files = _FileCache()
        # DeepSpeed's pipeline grid numbers the files of one DP replica stage-major: mp = stage * TP + tp_rank.
        self.index: dict[str, list[tuple[str, int, int, int]]] = {}
        for stage in range(pp):
            mp = stage * tp + tp_rank if pp > 1 else tp_rank
            found: dict[str, list[tuple[str, int, int, int]]] = {}
            for dp_rank in range(dp):
                path = optim_file(ckpt_dir, dp_rank, mp)
                optim = self._files.get(path)["optimizer_state_dict"]
                mappings = optim.get("param_slice_mappings")
                if mappings is None or "single_partition_of_fp32_groups" not in optim:
                    raise CheckpointError(f"{path} holds no fp32 partitions with slice mappings")
                for g, mapping in enumerate(mappings):
                    for name, fragment in mapping.items():
                        found.setdefault(name, []).append((path, g, int(fragment.start), int(fragment.numel)))
                self._files.release()
            for name, pieces in found.items():
                self.index.setdefault(name, pieces)  # a tied weight lives on two stages: take the first

    def has(self, name: str) -> bool:
        return name in self.index

    def read(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name not in self.index:
            raise CheckpointError(f"{self.ckpt_dir}: no fp32 partition of {name} for TP rank {self.tp_rank}")
        pieces = []
        for path, g, start, numel in self.index[name]:
            group = self._files.get(path)["optimizer_state_dict"]["single_partition_of_fp32_groups"][g]
            pieces.append(group[start:start + numel])
        flat = torch.cat(pieces)
        if flat.numel() != math.prod(shape):
            raise CheckpointError(f"{self.ckpt_dir}: fp32 partitions of {name} hold {flat.numel()} elements, "
                                  f"shape {tuple(shape)} needs {math.prod(shape)}")
        return flat.view(shape)

    def release(self) -> None:
        self._files.release()
