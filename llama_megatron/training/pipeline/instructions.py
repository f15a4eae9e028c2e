"""A rank's list of actions (schedules.py) lowered to the instructions our pipeline engine runs: the micro batch's
data where the first or the last virtual stage needs it, a receive before and a send after each pass to the rank
holding the neighbouring virtual stage (``peer``; None where that stage is this rank's other chunk, as at the turn
of a V: handed over in memory), and the optimizer step at the end of a training step.

Every instruction carries ``buffer_id`` (chunk x micro batches + micro batch: the engine's buffer of that chunk's
micro batch), ``chunk`` and ``micro_batch``; the instructions are DeepSpeed ``PipeInstruction`` objects, so
DeepSpeed's ``_exec_schedule`` runs them through the engine's instruction map (and the timeline can time them).
"""

from __future__ import annotations

from collections.abc import Iterator

from deepspeed.runtime.pipe import schedule as ds_schedule

from llama_megatron.parallel.pipeline_stages import StagePlacement
from llama_megatron.training.pipeline.schedules import Action


class LoadBatch(ds_schedule.PipeInstruction):
    """The next micro batch from the data iterator: its inputs (``inputs``, the first virtual stage's) into the
    buffer, its labels (``labels``, the last one's) into ``label_buffer``."""


class RecvActivation(ds_schedule.PipeInstruction):
    """The previous virtual stage's output, this chunk's input."""


class SendActivation(ds_schedule.PipeInstruction):
    """This chunk's output to the next virtual stage."""


class RecvGrad(ds_schedule.PipeInstruction):
    """The gradient of this chunk's output, from the next virtual stage."""


class SendGrad(ds_schedule.PipeInstruction):
    """The gradient of this chunk's input, to the previous virtual stage."""


class ChunkForward(ds_schedule.PipeInstruction):
    """F: the chunk's forward pass (and the loss on the last virtual stage)."""


class ChunkBackward(ds_schedule.PipeInstruction):
    """BW: the chunk's whole backward pass."""


class ChunkBackwardInput(ds_schedule.PipeInstruction):
    """B: the gradient of the chunk's input; its weight-gradient work queued for the matching W."""


class ChunkWeight(ds_schedule.PipeInstruction):
    """W: the queued weight gradients of the chunk's micro batch."""


PASSES = (ChunkForward, ChunkBackward, ChunkBackwardInput, ChunkWeight)  # compute: a rank is busy while one runs
BACKWARD = {"BW": ChunkBackward, "B": ChunkBackwardInput}


class ActionSchedule(ds_schedule.PipeSchedule):
    """One step's instructions of ``rank`` for its ``actions`` (one DeepSpeed step per action)."""

    def __init__(self, actions: list[Action], placement: StagePlacement, rank: int, micro_batches: int,
                 training: bool = True) -> None:
        super().__init__(micro_batches=micro_batches, stages=placement.ranks, stage_id=rank)
        self.actions, self.placement, self.training = actions, placement, training

    def num_pipe_buffers(self) -> int:
        return self.placement.chunks * self.micro_batches

    def _peer(self, stage: int) -> int | None:
        rank = self.placement.owner(stage)[0]
        return None if rank == self.stage_id else rank

    def steps(self) -> Iterator[list[ds_schedule.PipeInstruction]]:
        last = self.placement.stages - 1
        for op, chunk, k in self.actions:
            stage = self.placement.stage(self.stage_id, chunk)
            ids = dict(buffer_id=chunk * self.micro_batches + k, chunk=chunk, micro_batch=k)
            step: list[ds_schedule.PipeInstruction] = []
            if op == "F":
                holds_last = self.placement.holds(self.stage_id, last)
                label_buffer = self.placement.owner(last)[1] * self.micro_batches + k
                if stage == 0:
                    step.append(LoadBatch(**ids, inputs=True, labels=holds_last, label_buffer=label_buffer))
                else:
                    step.append(RecvActivation(**ids, peer=self._peer(stage - 1)))
                    if stage == last and not self.placement.holds(self.stage_id, 0):
                        step.append(LoadBatch(**ids, inputs=False, labels=True, label_buffer=label_buffer))
                step.append(ChunkForward(**ids))
                if stage < last:
                    step.append(SendActivation(**ids, peer=self._peer(stage + 1)))
            elif op == "W":
                step.append(ChunkWeight(**ids))
            else:
                if stage < last:
                    step.append(RecvGrad(**ids, peer=self._peer(stage + 1)))
                step.append(BACKWARD[op](**ids))
                if stage > 0:
                    step.append(SendGrad(**ids, peer=self._peer(stage - 1)))
            yield step
        if self.training:
            yield [ds_schedule.ReduceTiedGrads(), ds_schedule.ReduceGrads(), ds_schedule.OptimizerStep()]
