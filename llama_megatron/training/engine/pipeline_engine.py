"""DeepSpeed's pipeline engine with the whole model's gradient norm, and running a schedule of ours
(``pipeline.schedule``, training/pipeline/schedules.py).

:class:`GlobalNormPipelineEngine` (every pipeline run) clips plain fp32 (ZeRO-0) gradients by the norm one process
holding the whole model computes. DeepSpeed's ``clip_grad_norm_`` counts a parameter that is not tensor-parallel
only on rank 0 of its model-parallel group, which for a pipeline spans every stage: the norms and biases of the
later stages were left out, and the clip factor differed from one process's (observed: 5.5e-5 rel in the loss
after 6 steps of a PP2 run with o_proj biases, 4e-7 without). ZeRO-1/2/3 and the bf16 optimizer compute their
norm over the tensor-parallel rank and are right already. It also runs a stage's backward pass once when the stage
sends several floating-point tensors (a mixture-of-experts model's router statistics ride with the hidden states):
DeepSpeed runs one backward per tensor, which goes through the shared part of the stage twice and cannot re-enter a
reentrant activation checkpoint; one scalar, sum_i <output_i, received gradient_i>, hands every output exactly its
gradient in a single pass.


:class:`ActionPipelineEngine` is its subclass that runs the schedules of our own (``zb-h1``, ``interleaved-1f1b``,
``zb-v``; DeepSpeed's engine runs ``1f1b``): a rank holds one or more chunks of the layer list
(model/chunked_pipeline.py), its step is its list of actions (training/pipeline/schedules.py) lowered to
instructions (training/pipeline/instructions.py), and the engine runs each through DeepSpeed's own forward,
backward, loss and optimizer machinery with the chunk's place told to it (first or last virtual stage: data,
loss, the last stage's backward from the loss). Every micro batch of every chunk has its own buffer, so any order
a schedule gives runs. Sends are asynchronous (a rank sends while its neighbour works on another micro batch; a
blocking send would wait for it, or deadlock), each let go by a thread as it completes, all of them by the end of
the step's schedule; each message is tagged
with its kind, the stage boundary it crosses and its micro batch, so the order a neighbour receives in need not be
the order it was sent in. Micro batch 0's activation goes with a small header of shapes and dtypes; the other micro
batches of the step send the same shapes (checked by the sender; DeepSpeed's 1F1B engine fixes them for the whole
run), so each rank posts its next receive of each kind ahead, while it computes, and the bytes arrive off the
critical path (as Megatron's and torch.distributed.pipelining's schedules post theirs); gradients have the shapes
of the outputs sent.
B (``ChunkBackwardInput``) is DeepSpeed's backward pass with the linears' weight gradients queued under the chunk's
micro batch (parallel/weight_grad.py), W (``ChunkWeight``) runs that group. Nothing of DeepSpeed's module state is
replaced: :func:`initialize_pipeline_engine` builds the engine as ``deepspeed.initialize`` builds a
``PipelineEngine``, with our class.

With the bf16 optimizer each W is bracketed as DeepSpeed brackets a backward pass on a stage (clear the bf16
gradients, accumulate them into the fp32 ones after): a parameter's fp32 gradient receives its micro batches in
the same order, with zeros added where B left it nothing, so the sums are those of 1F1B.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator
from functools import lru_cache
from types import MethodType

import torch
import torch.distributed as dist
from deepspeed.runtime.pipe import schedule as ds_schedule
from deepspeed.runtime.pipe.engine import PipelineEngine

from llama_megatron.parallel.context import ParallelContext
from llama_megatron.parallel.weight_grad import WeightGradStore, attach_weight_grad_store
from llama_megatron.training.engine.experts import ExpertLayers, construct_engine
from llama_megatron.training.engine.pipeline_messages import (
    ACTIVATION,
    DTYPES,
    GRADIENT,
    HEADER,
    MAX_DIMS,
    MAX_TENSORS,
    RECEIVES,
    Receive,
    Sends,
)
from llama_megatron.training.engine.step_fence import ModelStepFence
from llama_megatron.training.pipeline import instructions as ins
from llama_megatron.training.pipeline.schedules import forward_actions, rank_actions, schedule_record


class GlobalNormPipelineEngine(ModelStepFence, ExpertLayers, PipelineEngine):
    """``PipelineEngine`` whose fp32 gradient clipping uses :func:`global_grad_norm`, whose stages run one
    backward pass whatever they send (module docstring), and that knows our expert layers (:class:`ExpertLayers`)."""

    pctx: ParallelContext  # set by initialize_pipeline_engine

    def holds_loss(self) -> bool:
        """This rank computes the loss (holds the head)."""
        return self.is_last_stage()

    def _exec_backward_pass(self, buffer_id: int) -> None:
        outputs = self.pipe_buffers["outputs"][buffer_id]
        floats = [t for t in outputs if t.is_floating_point()] if isinstance(outputs, tuple) else []
        if self.is_last_stage() or len(floats) < 2:
            return super()._exec_backward_pass(buffer_id)
        received = self.grad_layer  # DeepSpeed's receive buffers, reused for the next micro batch
        self.pipe_buffers["outputs"][buffer_id] = (sum((t * g).sum() for t, g in zip(floats, received)),)
        self.grad_layer = (torch.ones((), device=floats[0].device, dtype=floats[0].dtype),)
        try:
            super()._exec_backward_pass(buffer_id)
        finally:
            self.grad_layer = received

    _INSTRUCTION_MAP = {**PipelineEngine._INSTRUCTION_MAP, ds_schedule.BackwardPass: _exec_backward_pass}

    def clip_fp32_gradients(self) -> None:
        self.clip_by_global_norm()


@lru_cache(maxsize=64)
def _actions(schedule: str, ranks: int, rank: int, micro_batches: int, chunks: int) -> tuple:
    return tuple(rank_actions(schedule, ranks, rank, micro_batches, chunks))


class ActionPipelineEngine(GlobalNormPipelineEngine):
    """``PipelineEngine`` running a list of actions per rank over its chunks (module docstring)."""

    schedule = "zb-h1"  # set by initialize_pipeline_engine

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.placement = self.module.placement
        self.weight_grads = WeightGradStore()
        split = schedule_record(self.schedule).split_backward
        attach_weight_grad_store(self.module, self.weight_grads if split else None)
        self._sends = Sends()
        self._expected: dict[int, collections.deque[Receive]] = {}  # kind -> this step's remote receives, in order
        self._sent_meta: dict[int, tuple] = {}  # boundary -> micro batch 0's outputs this step: (tensors' meta, tuple?)
        self._received_meta: dict[int, tuple] = {}  # boundary -> micro batch 0's inputs this step, as received
        self._local: dict[tuple[int, int], tuple] = {}  # (kind, buffer) -> what a chunk hands its neighbour
        self._grads: dict[int, tuple] = {}  # buffer -> the received gradient of its outputs
        self._losses: dict[int, torch.Tensor] = {}  # buffer -> the last stage's loss, for its backward
        self._flags: tuple[bool, bool] | None = None
        self._buffers_per_chunk = self.micro_batches
        self.sent_bytes = 0  # by this rank's sends since the engine was made (the benchmark's)

    # ---- where the running chunk sits: DeepSpeed's code asks is_first_stage / is_last_stage ----
    def is_first_stage(self) -> bool:
        flags = getattr(self, "_flags", None)
        return super().is_first_stage() if flags is None else flags[0]

    def is_last_stage(self) -> bool:
        flags = getattr(self, "_flags", None)
        return super().is_last_stage() if flags is None else flags[1]

    def holds_loss(self) -> bool:
        return self.placement.loss_rank == self.stage_id

    @contextlib.contextmanager
    def _as_stage(self, first: bool, last: bool) -> Iterator[None]:
        outer, self._flags = self._flags, (first, last)
        try:
            yield
        finally:
            self._flags = outer

    def _chunk_stage(self, chunk: int) -> tuple[bool, bool]:
        stage = self.placement.stage(self.stage_id, chunk)
        return stage == 0, stage == self.placement.stages - 1

    def _rank_stage(self):
        """The rank as a whole: it reads data if it holds the first virtual stage, reports the loss if the last."""
        return self._as_stage(self.placement.holds(self.stage_id, 0), self.holds_loss())

    def _loss_stage_global_rank(self) -> int:
        return self.grid.stage_to_global(self.placement.loss_rank)

    def _aggregate_total_loss(self):
        with self._rank_stage():
            return super()._aggregate_total_loss()

    def eval_batch(self, *args, **kwargs):
        with self._rank_stage():
            return super().eval_batch(*args, **kwargs)

    # ---- the schedules ----
    def _train_schedule(self) -> ins.ActionSchedule:
        actions = _actions(self.schedule, self.placement.ranks, self.stage_id, self.micro_batches,
                           self.placement.chunks)
        return self._lowered(list(actions), self.micro_batches, True)

    def _inference_schedule(self, micro_batches: int) -> ins.ActionSchedule:
        return self._lowered(forward_actions(self.placement, self.stage_id, micro_batches), micro_batches, False)

    def _lowered(self, actions, micro_batches: int, training: bool) -> ins.ActionSchedule:
        self._buffers_per_chunk = micro_batches
        return ins.ActionSchedule(actions, self.placement, self.stage_id, micro_batches, training)

    def _exec_schedule(self, pipe_schedule) -> None:
        """DeepSpeed's loop over the step's instructions, with the next remote receive of each kind posted after
        every instruction as soon as its shapes are known (so after a receive, before its pass), so its bytes
        arrive while this rank computes (a receive posted only when its pass is due waits for a round trip and the
        copy, on the critical path)."""
        self._reserve_pipe_buffers(pipe_schedule.num_pipe_buffers())
        self.fwd_outputs = []
        commands = [cmd for step in pipe_schedule for cmd in step]
        self._plan_receives(commands)
        self._sent_meta.clear()
        self._received_meta.clear()
        try:
            for cmd in commands:
                self._run(cmd)
        finally:
            self._complete_sends()  # training and evaluation steps alike end with every send completed
        assert not any(self._expected.values()), "a receive is missing from the schedule"
        assert self.weight_grads.pending == 0, "a W pass is missing from the schedule"
        assert not (self._local or self._grads or self._losses), "a pass is missing from the schedule"

    def _run(self, cmd) -> None:
        run = self._INSTRUCTION_MAP.get(type(cmd))  # the instance's map: the timeline may time it
        if run is None:
            raise RuntimeError(f"{type(self).__name__} does not understand instruction {cmd!r}")
        self._exec_instr = MethodType(run, self)
        self._exec_instr(**cmd.kwargs)
        self._between_instructions()

    def _between_instructions(self) -> None:
        for expected in self._expected.values():
            if expected and not expected[0].posted:
                self._post(expected[0])

    def in_transit(self) -> list[torch.Tensor]:
        """Tensors held by communication: sends not known complete and receives posted ahead."""
        posted = [t for expected in self._expected.values() for r in expected for t in r.tensors]
        return self._sends.tensors() + posted

    # ---- data, passes ----
    def _exec_load_batch(self, buffer_id: int, chunk: int, micro_batch: int, inputs: bool, labels: bool,
                         label_buffer: int) -> None:
        with self._as_stage(inputs, labels):
            self._exec_load_micro_batch(buffer_id)
        if labels and label_buffer != buffer_id:
            self.pipe_buffers["labels"][label_buffer] = self.pipe_buffers["labels"][buffer_id]
            self.pipe_buffers["labels"][buffer_id] = None

    def _exec_chunk_forward(self, buffer_id: int, chunk: int, micro_batch: int) -> None:
        self.module.current_chunk = chunk
        first, last = self._chunk_stage(chunk)
        with self._as_stage(first, last):
            self._exec_forward_pass(buffer_id)
        if last:
            self.pipe_buffers["labels"][buffer_id] = None
            if self.module.training:
                self._losses[buffer_id] = self.loss
            else:  # evaluation keeps the loss only (DeepSpeed's `outputs` where logits are asked for)
                self.pipe_buffers["outputs"][buffer_id] = None
        if not self.module.training:
            self.pipe_buffers["inputs"][buffer_id] = None  # no backward will read it

    def _exec_chunk_backward(self, buffer_id: int, chunk: int, micro_batch: int) -> None:
        first, last = self._chunk_stage(chunk)
        if last:
            self.loss = self._losses.pop(buffer_id)
        else:
            grads = self._grads.pop(buffer_id)
            self.grad_layer = grads if isinstance(self.pipe_buffers["outputs"][buffer_id], tuple) else grads[0]
        try:
            with self._as_stage(first, last):
                self._exec_backward_pass(buffer_id)
        finally:
            self.grad_layer = None
        # DeepSpeed frees a stage's outputs after its backward but the last stage's, whose one buffer the next
        # micro batch overwrites: here each micro batch has its own
        self.pipe_buffers["outputs"][buffer_id] = None
        if first:
            self.pipe_buffers["inputs"][buffer_id] = None

    def _exec_chunk_backward_input(self, buffer_id: int, chunk: int, micro_batch: int) -> None:
        with self.weight_grads.input_gradients_only(buffer_id):
            self._exec_chunk_backward(buffer_id, chunk, micro_batch)

    def _exec_chunk_weight(self, buffer_id: int, chunk: int, micro_batch: int) -> None:
        bf16 = self.using_bf16_optimizer
        if bf16:
            self.optimizer.clear_lp_grads()
        self.weight_grads.run(buffer_id)
        if bf16 and not self._config.bfloat16_config.immediate_grad_update:
            self.optimizer.update_hp_grads(clear_lp_grads=False)

    # ---- communication ----
    def _neighbour_buffer(self, chunk: int, micro_batch: int, step: int) -> int:
        """The buffer of the same micro batch on the chunk holding the virtual stage ``step`` away (this rank's)."""
        _, other = self.placement.owner(self.placement.stage(self.stage_id, chunk) + step)
        return other * self._buffers_per_chunk + micro_batch

    def _tag(self, kind: int, boundary: int, micro_batch: int, index: int) -> int:
        """Each message's own tag: a neighbour receives by tag, in its own order."""
        return ((kind * self.placement.stages + boundary) * self._buffers_per_chunk + micro_batch) * (
            MAX_TENSORS + 1) + index

    def _isend(self, tensor: torch.Tensor, peer: int, tag: int) -> None:
        tensor = tensor.contiguous()
        self._sends.add(dist.isend(tensor, self.grid.stage_to_global(stage_id=peer), tag=tag), tensor)
        self.sent_bytes += tensor.numel() * tensor.element_size()

    def _irecv(self, receive: Receive, tensor: torch.Tensor, index: int) -> None:
        tag = self._tag(receive.kind, receive.boundary, receive.micro_batch, index)
        receive.works.append(dist.irecv(tensor, self.grid.stage_to_global(stage_id=receive.peer), tag=tag))
        receive.tensors.append(tensor)

    def _complete_sends(self) -> None:
        self._sends.wait_all()

    def _plan_receives(self, commands: list) -> None:
        """The step's receives from other ranks, per kind in the order its instructions will take them."""
        self._expected = {ACTIVATION: collections.deque(), GRADIENT: collections.deque()}
        for cmd in commands:
            kind = RECEIVES.get(type(cmd))
            if kind is None or cmd.kwargs["peer"] is None:
                continue
            stage = self.placement.stage(self.stage_id, cmd.kwargs["chunk"])
            self._expected[kind].append(Receive(kind, cmd.kwargs["buffer_id"], stage - 1 if kind == ACTIVATION
                                                 else stage, cmd.kwargs["micro_batch"], cmd.kwargs["peer"]))

    def _post(self, receive: Receive) -> bool:
        """Post ``receive``'s receives if what they receive into is known: micro batch 0's activation brings a
        header of shapes and dtypes (posted at once, its tensors on arrival), the others have micro batch 0's
        shapes (the activations as received, the gradients as this rank sent its outputs)."""
        if receive.kind == ACTIVATION and receive.micro_batch == 0 and receive.boundary not in self._received_meta:
            self._irecv(receive, torch.empty(HEADER, dtype=torch.int64, device=self.device), 0)
        else:
            meta = (self._received_meta if receive.kind == ACTIVATION else self._sent_meta).get(receive.boundary)
            if meta is None:
                return False
            shapes = meta[0] if receive.kind == ACTIVATION else [m for m in meta[0] if m[1].is_floating_point]
            first = 1 if receive.kind == ACTIVATION else 0
            for i, (shape, dtype) in enumerate(shapes):
                self._irecv(receive, torch.empty(shape, dtype=dtype, device=self.device), first + i)
        receive.posted = True
        return True

    def _take(self, kind: int, buffer_id: int) -> list[torch.Tensor]:
        """The received tensors of ``buffer_id``'s message of ``kind`` (the next one expected), waited for."""
        receive = self._expected[kind].popleft()
        assert receive.buffer == buffer_id, "receives taken out of the planned order"
        if not receive.posted:
            assert self._post(receive), "a gradient is received before its micro batch 0's activation was sent"
        for work in receive.works:
            work.wait()
        if receive.kind == ACTIVATION and receive.micro_batch == 0:  # the header: now its tensors
            header = receive.tensors[0].tolist()
            metas = []
            for i in range(header[0]):
                at = 2 + i * (2 + MAX_DIMS)
                metas.append((tuple(header[at + 2:at + 2 + header[at + 1]]), DTYPES[header[at]]))
            self._received_meta[receive.boundary] = (tuple(metas), bool(header[1]))
            receive.tensors, receive.works = [], []
            self._post(receive)
            for work in receive.works:
                work.wait()
        return receive.tensors

    def _exec_send_activation(self, buffer_id: int, chunk: int, micro_batch: int, peer: int | None) -> None:
        outputs = self.pipe_buffers["outputs"][buffer_id]
        tensors = outputs if isinstance(outputs, tuple) else (outputs,)
        if not self.module.training:
            self.pipe_buffers["outputs"][buffer_id] = None
        if peer is None:
            self._local[(ACTIVATION, self._neighbour_buffer(chunk, micro_batch, 1))] = (
                tuple(t.detach() for t in tensors), isinstance(outputs, tuple))
            return
        boundary = self.placement.stage(self.stage_id, chunk)
        meta = (tuple((tuple(t.shape), t.dtype) for t in tensors), isinstance(outputs, tuple))
        if micro_batch == 0:
            if len(tensors) > MAX_TENSORS or max(t.dim() for t in tensors) > MAX_DIMS:
                raise ValueError(f"a pipeline stage sends at most {MAX_TENSORS} tensors of {MAX_DIMS} dimensions")
            header = torch.zeros(HEADER, dtype=torch.int64)
            header[0], header[1] = len(tensors), meta[1]
            for i, t in enumerate(tensors):
                at = 2 + i * (2 + MAX_DIMS)
                header[at], header[at + 1] = DTYPES.index(t.dtype), t.dim()
                header[at + 2:at + 2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
            self._sent_meta[boundary] = meta
            self._isend(header.to(self.device), peer, self._tag(ACTIVATION, boundary, micro_batch, 0))
        elif meta != self._sent_meta[boundary]:  # the receiver posted micro batch 0's shapes
            raise ValueError(f"the micro batches of one step must send the same shapes across a pipeline stage "
                             f"boundary: micro batch 0 sent {self._sent_meta[boundary]}, micro batch {micro_batch} "
                             f"{meta}")
        for i, t in enumerate(tensors):
            self._isend(t.detach(), peer, self._tag(ACTIVATION, boundary, micro_batch, i + 1))

    def _exec_recv_activation(self, buffer_id: int, chunk: int, micro_batch: int, peer: int | None) -> None:
        if peer is None:
            tensors, was_tuple = self._local.pop((ACTIVATION, buffer_id))
        else:
            tensors = self._take(ACTIVATION, buffer_id)
            was_tuple = self._received_meta[self.placement.stage(self.stage_id, chunk) - 1][1]
        received = []
        for t in tensors:  # a leaf, as DeepSpeed's receive makes it: the chunk's backward leaves its gradient here
            t = t.detach()
            t.requires_grad = t.is_floating_point()
            received.append(t)
        self.pipe_buffers["inputs"][buffer_id] = tuple(received) if was_tuple else received[0]

    def _exec_recv_grad(self, buffer_id: int, chunk: int, micro_batch: int, peer: int | None) -> None:
        if peer is None:
            self._grads[buffer_id] = self._local.pop((GRADIENT, buffer_id))
            return
        self._grads[buffer_id] = tuple(self._take(GRADIENT, buffer_id))

    def _exec_send_grad(self, buffer_id: int, chunk: int, micro_batch: int, peer: int | None) -> None:
        inputs = self.pipe_buffers["inputs"][buffer_id]
        grads = []
        for t in inputs if isinstance(inputs, tuple) else (inputs,):
            if t.is_floating_point():
                assert t.grad is not None, "a pipeline stage's input received no gradient"
                grads.append(t.grad)
        self.pipe_buffers["inputs"][buffer_id] = None
        if peer is None:
            self._local[(GRADIENT, self._neighbour_buffer(chunk, micro_batch, -1))] = tuple(grads)
            return
        boundary = self.placement.stage(self.stage_id, chunk) - 1
        for i, grad in enumerate(grads):
            self._isend(grad, peer, self._tag(GRADIENT, boundary, micro_batch, i))

    # DeepSpeed's map holds its functions, not methods looked up on the instance: ours are named here
    _INSTRUCTION_MAP = {
        **GlobalNormPipelineEngine._INSTRUCTION_MAP,
        ins.LoadBatch: _exec_load_batch, ins.RecvActivation: _exec_recv_activation,
        ins.SendActivation: _exec_send_activation, ins.RecvGrad: _exec_recv_grad, ins.SendGrad: _exec_send_grad,
        ins.ChunkForward: _exec_chunk_forward, ins.ChunkBackward: _exec_chunk_backward,
        ins.ChunkBackwardInput: _exec_chunk_backward_input, ins.ChunkWeight: _exec_chunk_weight,
    }


def initialize_pipeline_engine(model, optimizer, lr_scheduler, config: dict, pctx: ParallelContext,
                               schedule: str = "1f1b"):
    """``deepspeed.initialize`` for a ``PipelineModule`` with our engine class (:class:`ActionPipelineEngine` for
    the schedules it runs, over a ``ChunkedPipelineModule``; else :class:`GlobalNormPipelineEngine`): the same
    steps (DeepSpeed's config object from the module's topology, optimizer flags, the engine) with our class."""
    if schedule_record(schedule).deepspeed_runs_it:
        engine_class: type = GlobalNormPipelineEngine
    else:
        engine_class = type(f"ActionPipelineEngine[{schedule}]", (ActionPipelineEngine,), {"schedule": schedule})
    return construct_engine(engine_class, model, optimizer, lr_scheduler, config, model.mpu(), pctx)
