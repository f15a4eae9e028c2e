"""The one object that knows the process groups.

Groups come from DeepSpeed's ``PipeModelDataParallelTopology`` (axes pipe, data, model; "model" is tensor
parallel), so the ranks we use for TP match the ranks DeepSpeed's pipeline engine uses. The object is passed
explicitly to every layer and to ``deepspeed.initialize(mpu=...)``; it also works with no ``torch.distributed``
at all (world size 1), where every group is ``None`` and every collective is the identity.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from llama_megatron.errors import ConfigError


@dataclass
class ParallelContext:
    tp_size: int = 1
    pp_size: int = 1
    dp_size: int = 1
    tp_rank: int = 0
    pp_rank: int = 0
    dp_rank: int = 0
    rank: int = 0
    world_size: int = 1
    sequence_parallel: bool = False
    tp_group: Any = None
    pp_group: Any = None
    dp_group: Any = None
    topology: Any = None
    dp_group_ranks: tuple[int, ...] = (0,)

    @classmethod
    def single(cls) -> ParallelContext:
        """One process, no torch.distributed needed."""
        return cls()

    @classmethod
    def build(cls, tensor: int = 1, pipeline: int = 1, sequence_parallel: bool = False) -> ParallelContext:
        """Create TP/PP/DP groups over the initialised default process group (or a single-process context)."""
        if not dist.is_available() or not dist.is_initialized():
            if tensor * pipeline != 1:
                raise ConfigError(
                    f"tensor x pipeline = {tensor * pipeline} needs torch.distributed; launch with deepspeed/torchrun"
                )
            return cls.single()
        from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

        world_size = dist.get_world_size()
        if world_size % (tensor * pipeline):
            raise ConfigError(
                f"world size {world_size} is not divisible by tensor x pipeline = {tensor} x {pipeline}"
            )
        if sequence_parallel and tensor == 1:
            raise ConfigError("sequence_parallel needs tensor parallel degree > 1")
        dp = world_size // (tensor * pipeline)
        topo = PipeModelDataParallelTopology(num_pp=pipeline, num_mp=tensor, num_dp=dp)
        rank = dist.get_rank()
        # Every rank must create every group, in the same order, even those it is not part of.
        groups = {}
        for axis in ("model", "pipe", "data"):
            for ranks in topo.get_axis_comm_lists(axis):
                # One-rank groups are real groups too: DeepSpeed reduces over the DP group even at DP=1.
                group = dist.new_group(ranks=ranks)
                if rank in ranks:
                    groups[axis] = (group, tuple(ranks))
        coord = topo.get_coord(rank)
        return cls(
            tp_size=tensor,
            pp_size=pipeline,
            dp_size=dp,
            tp_rank=coord.model,
            pp_rank=coord.pipe,
            dp_rank=coord.data,
            rank=rank,
            world_size=world_size,
            sequence_parallel=sequence_parallel,
            tp_group=groups["model"][0],
            pp_group=groups["pipe"][0],
            dp_group=groups["data"][0],
            topology=topo,
            dp_group_ranks=groups["data"][1],
        )

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    # ---- the mpu interface DeepSpeed expects (``deepspeed.initialize(mpu=ctx)``) ----
    # DeepSpeed calls tensor parallelism "model parallelism".
    def get_model_parallel_rank(self) -> int:
        return self.tp_rank

    def get_model_parallel_world_size(self) -> int:
        return self.tp_size

    def get_model_parallel_group(self):
        return self.tp_group

    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group

    def get_tensor_model_parallel_src_rank(self) -> int:
        return self.rank - self.tp_rank

    def get_pipe_parallel_rank(self) -> int:
        return self.pp_rank

    def get_pipe_parallel_world_size(self) -> int:
        return self.pp_size

    def get_pipe_parallel_group(self):
        return self.pp_group

    def get_data_parallel_rank(self) -> int:
        return self.dp_rank

    def get_data_parallel_world_size(self) -> int:
        return self.dp_size

    def get_data_parallel_group(self):
        return self.dp_group

    def get_data_parallel_group_ranks(self) -> list[int]:
        return list(self.dp_group_ranks)

