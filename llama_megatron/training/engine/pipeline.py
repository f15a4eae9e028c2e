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

:class:`ScheduledPipelineEngine` is its subclass: its ``_train_schedule`` returns our schedule, its
instruction map adds B (:class:`BackwardInputPass`: DeepSpeed's backward pass with the linears' weight gradients
queued, parallel/weight_grad.py) and W (:class:`WeightPass`), and its sends are asynchronous (ZB-H1 sends while
the neighbouring stage works on another micro batch; a blocking send would wait for it, or deadlock), completed
when each batch's schedule ends. Nothing of DeepSpeed's module state is replaced: :func:`initialize_pipeline_engine`
builds the engine as ``deepspeed.initialize`` builds a ``PipelineEngine``, with our class.

With the bf16 optimizer each W is bracketed as DeepSpeed brackets a backward pass on a stage (clear the bf16
gradients, accumulate them into the fp32 ones after): a parameter's fp32 gradient receives its micro batches in
the same order, with zeros added where B left it nothing, so the sums are those of 1F1B.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from deepspeed.runtime.pipe import schedule as ds_schedule
from deepspeed.runtime.pipe.engine import PipelineEngine

from llama_megatron.parallel.context import ParallelContext
from llama_megatron.parallel.weight_grad import WeightGradStore, attach_weight_grad_store
from llama_megatron.training.engine.experts import ExpertLayers, construct_engine
from llama_megatron.training.pipeline.schedules import BackwardInputPass, WeightPass, ZeroBubbleH1Schedule


class GlobalNormPipelineEngine(ExpertLayers, PipelineEngine):
    """``PipelineEngine`` whose fp32 gradient clipping uses :func:`global_grad_norm`, whose stages run one
    backward pass whatever they send (module docstring), and that knows our expert layers (:class:`ExpertLayers`)."""

    pctx: ParallelContext  # set by initialize_pipeline_engine

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


class ScheduledPipelineEngine(GlobalNormPipelineEngine):
    """``PipelineEngine`` with the ZB-H1 schedule, its B and W passes and asynchronous sends."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.weight_grads = WeightGradStore()
        attach_weight_grad_store(self.module, self.weight_grads)
        self._sends: list[tuple[object, torch.Tensor]] = []

    def _train_schedule(self):
        return ZeroBubbleH1Schedule(micro_batches=self.micro_batches, stages=self.num_stages, stage_id=self.stage_id)

    def _exec_backward_input_pass(self, buffer_id: int) -> None:
        # DeepSpeed receives every output gradient into one reused buffer; the deferred weight gradient of the
        # stage's last linear may hold that very tensor (a residual add passes it through), so B gets a copy
        received = self.grad_layer
        if received is not None and not self.is_last_stage():
            self.grad_layer = (received.clone() if isinstance(received, torch.Tensor)
                               else [t.clone() for t in received])
        try:
            with self.weight_grads.input_gradients_only():
                self._exec_backward_pass(buffer_id)
        finally:
            self.grad_layer = received

    def _exec_weight_pass(self) -> None:
        bf16 = self.using_bf16_optimizer
        if bf16:
            self.optimizer.clear_lp_grads()
        self.weight_grads.run_oldest()
        if bf16 and not self._config.bfloat16_config.immediate_grad_update:
            self.optimizer.update_hp_grads(clear_lp_grads=False)

    # ---- asynchronous sends: DeepSpeed's p2p.send blocks ----
    def _isend(self, tensor: torch.Tensor, stage: int) -> None:
        tensor = tensor.contiguous()
        self._sends.append((dist.isend(tensor, self.grid.stage_to_global(stage_id=stage)), tensor))

    def _complete_sends(self) -> None:
        for work, _ in self._sends:
            work.wait()
        self._sends.clear()

    def _exec_send_activations(self, buffer_id: int) -> None:
        outputs = self.pipe_buffers["outputs"][buffer_id]
        if self.dynamic_shape or self.first_output_send:
            self.first_output_send = False
            self._send_tensor_meta(outputs, self.next_stage)
        for tensor in outputs if isinstance(outputs, tuple) else (outputs,):
            self._isend(tensor, self.next_stage)

    def _exec_send_grads(self, buffer_id: int) -> None:
        inputs = self.pipe_buffers["inputs"][buffer_id]
        for tensor in inputs if isinstance(inputs, tuple) else (inputs,):
            if tensor.is_floating_point():
                assert tensor.grad is not None
                self._isend(tensor.grad, self.prev_stage)
        self.pipe_buffers["inputs"][buffer_id] = None

    def _exec_schedule(self, pipe_schedule) -> None:
        super()._exec_schedule(pipe_schedule)
        self._complete_sends()  # training and evaluation batches alike end with every send completed
        assert self.weight_grads.pending == 0, "a W pass is missing from the schedule"

    # DeepSpeed's map holds its functions, not methods looked up on the instance: ours are named here
    _INSTRUCTION_MAP = {**GlobalNormPipelineEngine._INSTRUCTION_MAP, BackwardInputPass: _exec_backward_input_pass,
                        WeightPass: _exec_weight_pass, ds_schedule.SendActivation: _exec_send_activations,
                        ds_schedule.SendGrad: _exec_send_grads}


def initialize_pipeline_engine(model, optimizer, lr_scheduler, config: dict, pctx: ParallelContext,
                               schedule: str = "1f1b"):
    """``deepspeed.initialize`` for a ``PipelineModule`` with our engine class (:class:`ScheduledPipelineEngine` for
    ``zb-h1``, else :class:`GlobalNormPipelineEngine`): the same steps (DeepSpeed's config object from the module's
    topology, optimizer flags, the engine) with our class."""
    engine_class = ScheduledPipelineEngine if schedule == "zb-h1" else GlobalNormPipelineEngine
    return construct_engine(engine_class, model, optimizer, lr_scheduler, config, model.mpu(), pctx)
