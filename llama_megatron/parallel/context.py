"""The one object that knows the process groups.

Groups come from DeepSpeed's ``PipeModelDataParallelTopology`` (axes pipe, data, model; "model" is tensor
parallel), so the ranks we use for TP match the ranks DeepSpeed's pipeline engine uses. The object is passed
explicitly to every layer and to ``deepspeed.initialize(mpu=...)``; it also works with no ``torch.distributed``
at all (world size 1), where every group is ``None`` and every collective is the identity.

Expert parallelism (EP) splits the MoE experts over groups of ``expert`` ranks along the data axis (consecutive
coordinates of one pipeline stage and TP rank, the groups DeepSpeed's ``groups._create_expert_data_and_model_parallel``
forms for this topology): the EP group exchanges tokens (all-to-all) and the expert-data-parallel group (the ranks
holding the same experts, stride ``expert`` along the axis) reduces the experts' gradients.

Context parallelism (CP) lives inside the topology's data axis, as DeepSpeed-Ulysses places its sequence ranks:
the axis has DP x CP coordinates d = dp_rank x CP + cp_rank (so rank order is TP fastest, then CP, DP, PP, as in
Megatron-Core). Everything DeepSpeed does over "data parallel" (averaging gradients, ZeRO partitioning, the
pipeline engine's loss average, the broadcast of the initial weights) then runs over DP x CP, in both engines:
DeepSpeed's own sequence-parallel hooks (an mpu's ``get_sequence_parallel_*``) are honoured only by the
non-pipeline engine, so they are deliberately not offered. The gradient over DP x CP is right because the loss of
every CP rank is its shard's share of the global token sum (training/engine/training_engine.py, "the loss rule"): averaging over
DP x CP ranks is then the sum over the CP shards of each sample. Our own code keeps the pure groups: ``dp_*`` (which
samples a rank reads) and ``cp_*`` (the Ulysses all-to-all).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from llama_megatron.errors import ConfigError
from llama_megatron.parallel.degrees import ParallelConfig


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
    dp_group: Any = None  # pure data parallel: the ranks that read different samples
    topology: Any = None
    cp_size: int = 1
    cp_rank: int = 0
    cp_group: Any = None  # context parallel: the shards of the same samples (None at CP 1)
    dp_cp_group: Any = None  # DP x CP, DeepSpeed's data-parallel group (the topology's data axis)
    dp_cp_group_ranks: tuple[int, ...] = (0,)
    ep_size: int = 1
    ep_rank: int = 0
    ep_group: Any = None  # expert parallel: the ranks whose experts together make a whole MoE layer
    edp_group: Any = None  # expert data parallel: the ranks holding this rank's experts (the data axis at EP 1)
    ep_group_ranks: tuple[int, ...] = (0,)
    edp_group_ranks: tuple[int, ...] = (0,)

    @classmethod
    def single(cls) -> ParallelContext:
        """One process, no torch.distributed needed."""
        return cls()

    @classmethod
    def build(cls, degrees: ParallelConfig | None = None, **layout: Any) -> ParallelContext:
        """Create TP/PP/CP/DP(/EP) groups over the initialised default process group (or a single-process
        context) for ``degrees`` (or its fields given as keywords), checked against the world size by the degrees
        object itself (parallel/degrees.py: the one place that knows their rules)."""
        degrees = ParallelConfig(**layout) if degrees is None else degrees
        degrees.check_degrees()
        tensor, pipeline, context, expert = degrees.tensor, degrees.pipeline, degrees.context, degrees.expert
        sequence_parallel = degrees.sequence_parallel
        if not dist.is_available() or not dist.is_initialized():
            if tensor * pipeline * context * expert != 1:
                raise ConfigError(
                    f"tensor x pipeline x context x expert = {tensor * pipeline * context * expert} needs "
                    "torch.distributed; launch with deepspeed/torchrun"
                )
            return cls.single()
        from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

        world_size = dist.get_world_size()
        degrees.check_world_size(world_size)
        dp = degrees.data_parallel_size(world_size)
        topo = PipeModelDataParallelTopology(num_pp=pipeline, num_mp=tensor, num_dp=dp * context)
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
        dp_group, cp_group = groups["data"][0], None
        if context > 1:
            dp_group, cp_group = _split_data_axis(topo, rank, dp, context)
        (ep_group, ep_ranks), (edp_group, edp_ranks) = (_expert_groups(topo, rank, expert) if expert > 1 else
                                                         ((None, (rank,)), groups["data"]))
        return cls(
            tp_size=tensor,
            pp_size=pipeline,
            dp_size=dp,
            tp_rank=coord.model,
            pp_rank=coord.pipe,
            dp_rank=coord.data // context,
            rank=rank,
            world_size=world_size,
            sequence_parallel=sequence_parallel,
            tp_group=groups["model"][0],
            pp_group=groups["pipe"][0],
            dp_group=dp_group,
            topology=topo,
            cp_size=context,
            cp_rank=coord.data % context,
            cp_group=cp_group,
            dp_cp_group=groups["data"][0],
            dp_cp_group_ranks=groups["data"][1],
            ep_size=expert,
            ep_rank=coord.data % expert,
            ep_group=ep_group,
            edp_group=edp_group,
            ep_group_ranks=ep_ranks,
            edp_group_ranks=edp_ranks,
        )

    @property
    def dp_cp_size(self) -> int:
        return self.dp_size * self.cp_size

    @property
    def dp_cp_rank(self) -> int:
        return self.dp_rank * self.cp_size + self.cp_rank

    @property
    def expert_group_name(self) -> str:
        """DeepSpeed's name for the expert groups of this EP degree (its ``groups`` registry key)."""
        return f"ep_size_{self.ep_size}"

    def register_expert_groups(self) -> None:
        """Have DeepSpeed form its expert groups for this layout (its engine reduces the experts' gradients and
        partitions their ZeRO state over them) and check they are this context's, rank for rank."""
        from deepspeed.utils import groups

        name = self.expert_group_name
        mine = (self.ep_group_ranks, self.edp_group_ranks)
        if name in groups._get_expert_parallel_group_dict() and mine != (
                tuple(groups._get_expert_parallel_group_ranks(name)),
                tuple(groups._get_expert_data_parallel_group_ranks(name))):
            # DeepSpeed caches one set per EP degree for the life of the process and has no reset: an earlier run in
            # this process (several runs in one launch, a notebook) left another layout's groups under the name
            for registry in (groups._EXPERT_PARALLEL_GROUP, groups._EXPERT_PARALLEL_GROUP_RANKS,
                             groups._EXPERT_DATA_PARALLEL_GROUP, groups._EXPERT_DATA_PARALLEL_GROUP_RANKS):
                registry.pop(name, None)
        if name not in groups._get_expert_parallel_group_dict():
            # the layout of DeepSpeed's expert tensor parallelism (experts TP-split, as ours): EP and expert-DP groups
            # within one TP lane (its other layouts let an expert-DP group span TP ranks, for experts replicated
            # over TP)
            groups._create_expert_data_and_model_parallel(self.ep_size, mpu=self)
        theirs = (tuple(groups._get_expert_parallel_group_ranks(name)),
                  tuple(groups._get_expert_data_parallel_group_ranks(name)))
        if theirs != mine:
            raise RuntimeError(f"DeepSpeed's expert groups {theirs} differ from this layout's {mine}")

    @contextmanager
    def whole_sequences(self) -> Iterator[None]:
        """Within it every rank's forward takes whole sequences: sequence parallelism and context parallelism off.
        Neither splits a weight (SP cuts activations over TP, Ulysses CP cuts tokens and replicates the weights), so
        each TP rank computes its share of any sequence alone, with the same sums as the split forward: inference
        (lm-eval requests of any length, one token at a time from a KV cache) needs no sequence divisible by TP or
        CP. Only the forward reads the two fields; the groups and DeepSpeed's view of the layout are untouched."""
        saved = self.sequence_parallel, self.cp_size, self.cp_rank
        self.sequence_parallel, self.cp_size, self.cp_rank = False, 1, 0
        try:
            yield
        finally:
            self.sequence_parallel, self.cp_size, self.cp_rank = saved

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

    # DeepSpeed's "data parallel" is DP x CP (module docstring): it reduces gradients and partitions ZeRO state there.
    def get_data_parallel_rank(self) -> int:
        return self.dp_cp_rank

    def get_data_parallel_world_size(self) -> int:
        return self.dp_cp_size

    def get_data_parallel_group(self):
        return self.dp_cp_group

    def get_data_parallel_group_ranks(self) -> list[int]:
        return list(self.dp_cp_group_ranks)


def _expert_groups(topo, rank: int, expert: int) -> tuple[tuple[Any, tuple[int, ...]], tuple[Any, tuple[int, ...]]]:
    """This rank's EP group (data coordinates [j x expert, (j + 1) x expert)) and expert-data-parallel group (the
    coordinates equal to it modulo ``expert``), per pipeline stage and TP rank, each with its ranks. Every rank
    creates every group."""
    data = topo.get_dim("data")
    mine = {}
    for pipe in range(topo.get_dim("pipe")):
        for model in range(topo.get_dim("model")):
            ep_lists = [list(range(j * expert, (j + 1) * expert)) for j in range(data // expert)]
            edp_lists = [list(range(p, data, expert)) for p in range(expert)]
            for kind, lists in (("ep", ep_lists), ("edp", edp_lists)):
                for coords in lists:
                    ranks = [topo.get_rank(pipe=pipe, data=d, model=model) for d in coords]
                    group = dist.new_group(ranks=ranks)
                    if rank in ranks:
                        mine[kind] = (group, tuple(ranks))
    return mine["ep"], mine["edp"]


def _split_data_axis(topo, rank: int, dp: int, context: int) -> tuple[Any, Any]:
    """This rank's pure DP group and CP group, out of the data axis (coordinate dp_rank x context + cp_rank).
    Every rank creates every group, in the same order."""
    mine = {}
    for pipe in range(topo.get_dim("pipe")):
        for model in range(topo.get_dim("model")):
            dp_lists = [[d * context + c for d in range(dp)] for c in range(context)]
            cp_lists = [[d * context + c for c in range(context)] for d in range(dp)]
            for kind, lists in (("dp", dp_lists), ("cp", cp_lists)):
                for coords in lists:
                    ranks = [topo.get_rank(pipe=pipe, data=d, model=model) for d in coords]
                    group = dist.new_group(ranks=ranks)
                    if rank in ranks:
                        mine[kind] = group
    return mine["dp"], mine["cp"]
