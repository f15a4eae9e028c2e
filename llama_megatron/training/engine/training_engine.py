"""DeepSpeed engine for a run: PipelineEngine for PP>1, the ordinary engine (ZeRO-0..3) for PP=1.

Both are driven through one interface, ``train_step(micro_batches)`` and ``eval_loss(micro_batches)``, where a
micro batch is a :class:`MicroBatch` of this data-parallel rank.

The loss rule: a step's loss is sum(token losses over the unmasked labels of the global batch) / (number of
unmasked labels in the global batch), independent of the micro batch count, DP, CP and PP. DeepSpeed divides each
micro batch's loss by the gradient accumulation steps M and averages gradients over its data-parallel group, which
is DP x CP (parallel/context.py), so each rank's micro batch loss is the sum of its token losses (of its sequence
shard, under CP) divided by N / (M x DP x CP), N the global count: the host counts its labels (CPU tensors, before
they move), one all-reduce over DP x CP per step sums the counts, and the divisor rides with the labels
(``(labels, divisor)``, to the last stage's loss_fn under PP). The CP ranks' losses of a sample then add up to its
share of the global mean, as one rank holding the whole sample computes it. Pretraining batches, all of whose
labels count, get the divisor micro_batch x seq_length / CP: the per-micro-batch token mean they always had.
Evaluation uses the same rule over its batches.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator

from llama_megatron.data.batch import MicroBatch
from llama_megatron.model.build import build_model
from llama_megatron.model.moe import pack_experts
from llama_megatron.model.routing import keep_routing_biases_fp32, update_routing_biases
from llama_megatron.parallel.context import ParallelContext
from llama_megatron.parallel.float8 import amax_record, collect_amax
from llama_megatron.training.config import TrainingConfig
from llama_megatron.training.engine.deepspeed_config import precision
from llama_megatron.training.engine.experts import global_grad_norm, initialize_engine
from llama_megatron.training.engine.lr_schedule import build_scheduler
from llama_megatron.training.engine.optimizer import build_optimizer
from llama_megatron.training.engine.pipeline_engine import initialize_pipeline_engine
from llama_megatron.training.objectives import objective_of


class TrainingEngine:
    def __init__(self, config: TrainingConfig, ds_config: dict, pctx: ParallelContext,
                 model: torch.nn.Module | None = None) -> None:
        """Wrap ``model`` (default: the seeded initial model of ``config``) in DeepSpeed's engine."""
        self.config = config
        self.pctx = pctx
        self.device = torch.device(get_accelerator().current_device_name())
        self.pipelined = pctx.pp_size > 1
        if model is None:
            model = build_model(
                config.model, config.parallel, pctx, seed=config.seed,
                activation_checkpoint_interval=config.activation_checkpointing.interval,
                partition_method=config.pipeline.partition_method, lora=config.lora,
                placement=config.pipeline.placement(pctx.pp_size), stage_layers=config.pipeline.stage_layers,
                fp8=config.fp8,
            )
        model.to(self.device)
        # after the move, before the optimizer and DeepSpeed hold the parameters, in the dtype DeepSpeed trains in
        pack_experts(model, {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision(ds_config)))
        offload = ds_config.get("zero_optimization", {}).get("offload_optimizer", {}).get("device") == "cpu"
        optimizer = build_optimizer(model, config.optimizer, offload_to_cpu=offload, experts=pctx.ep_size > 1)
        total_steps = config.train.steps
        lr_scheduler = lambda opt: build_scheduler(opt, config.optimizer, total_steps)  # noqa: E731
        if self.pipelined:
            self.engine, self.optimizer, _, self.scheduler = initialize_pipeline_engine(
                model, optimizer, lr_scheduler, ds_config, pctx, config.pipeline.schedule)
        else:
            self.engine, self.optimizer, _, self.scheduler = initialize_engine(
                model, optimizer, lr_scheduler, ds_config, pctx)
        self.model = model
        keep_routing_biases_fp32(model)
        # only a family with routing biases walks its modules after each step
        moe = config.model.family.moe
        self._bias_update_rate = config.moe.bias_update_rate if moe is not None and moe.router_bias else 0.0
        self._grad_norm: torch.Tensor | None = None
        self._expert_counts: torch.Tensor | None = None
        self.objective = objective_of(config)
        model.loss_fn.objective = self.objective.loss(config, pctx)
        # a precomputed reference's log-probabilities (preference pairs: [pairs of the data, 2], chosen and
        # rejected, by the pair's sample id); None while they are being computed (training/run/reference.py)
        self.reference_logps: torch.Tensor | None = None
        self._metric_sums: torch.Tensor | None = None
        if config.fp8 is not None and config.logging.fp8_stats:  # each FP8 linear keeps its window's amaxes
            for module in model.modules():
                if getattr(module, "float8", None) is not None:
                    module.float8.window_amax = {}

    def train_step(self, micro_batches: list[MicroBatch]) -> torch.Tensor:
        """One optimizer step over this rank's micro batches; the loss averaged over DP ranks, left on the device
        (reading it is a host sync: the loop does that only on logging steps)."""
        loss_fn = self.model.loss_fn
        loss_fn.expert_counts = loss_fn.metric_sums = None
        loss = self._train_step(micro_batches)
        if self._bias_update_rate:  # DeepSeek-V3's routing biases, by the step's loads (model/routing.py)
            update_routing_biases(self.model, self.pctx, self._bias_update_rate)
        self._expert_counts = loss_fn.expert_counts  # this step's routing, kept from evaluation's
        self._metric_sums = loss_fn.metric_sums  # on the ranks holding the loss
        return loss

    def _train_step(self, micro_batches: list[MicroBatch]) -> torch.Tensor:
        self.engine.train()
        targets = self._loss_targets(micro_batches)
        if self.pipelined:
            return self.engine.train_batch(data_iter=self._pipeline_batches(micro_batches, targets))
        total = torch.zeros((), device=self.device)
        self._grad_norm = None
        for mb, target in zip(micro_batches, targets):
            mb = mb.to(self.device)
            loss = self.engine(mb.input_ids, mb.position_ids, mb.segment_ids, target)
            self.engine.backward(loss)
            if self.engine.is_gradient_accumulation_boundary() and not self.engine.zero_optimization():
                # DeepSpeed clips plain (ZeRO-0) fp32 gradients without keeping the norm: measure it here,
                # after its data-parallel all-reduce and before the clipping step.
                self._grad_norm = global_grad_norm(self.model.parameters(), self.pctx, self.device)
            self.engine.step()
            total += loss.detach().float()
        return self._dp_mean(total / len(micro_batches))

    @torch.no_grad()
    def eval_loss(self, micro_batches: list[MicroBatch], progress: Callable[[], None] | None = None) -> float:
        """The mean loss over ``micro_batches``; ``progress`` is called before each forward of the model (every
        pipeline stage runs one per micro batch and chunk: the watchdog's beat through a long evaluation)."""
        hook = self.engine.module.register_forward_pre_hook(lambda *_: progress()) if progress else None
        try:
            return self._eval_loss(micro_batches)
        finally:
            if hook is not None:
                hook.remove()

    def _eval_loss(self, micro_batches: list[MicroBatch]) -> float:
        self.engine.eval()
        targets = self._loss_targets(micro_batches)
        if self.pipelined:
            loss = float(self.engine.eval_batch(data_iter=self._pipeline_batches(micro_batches, targets),
                                                num_micro_batches=len(micro_batches)))
        else:
            total = torch.zeros((), device=self.device)
            for mb, target in zip(micro_batches, targets):
                mb = mb.to(self.device)
                total += self.engine(mb.input_ids, mb.position_ids, mb.segment_ids, target).float()
            loss = float(self._dp_mean(total / len(micro_batches)))
        self.engine.train()
        return loss

    def _pipeline_batches(self, micro_batches: list[MicroBatch], targets: list):
        """DeepSpeed's pipeline engine pulls ((inputs...), labels) tuples from an iterator."""
        return iter([(mb.to(self.device).model_inputs(), target) for mb, target in zip(micro_batches, targets)])

    def _loss_targets(self, micro_batches: list[MicroBatch]) -> list:
        """Each micro batch's second argument of the loss, on the device: the objective's targets (the token loss:
        its labels and the divisor of the loss rule); the labels alone on pipeline stages without the loss."""
        return self.objective.targets(self, micro_batches)

    def holds_loss(self) -> bool:
        """This rank computes the loss (the last pipeline stage's ranks; every rank without a pipeline)."""
        return not self.pipelined or self.engine.holds_loss()

    def objective_metrics(self) -> dict[str, float] | None:
        """The objective's metrics of the last training step (means over the global batch: TRL's preference
        metrics over its pairs, GRPO's over its completion tokens), on every rank; None where it has none. One all-reduce over the world of the sums its loss
        returned: they live on the last stage, the same on each of its TP and CP ranks (so the copies cancel in the
        ratios the metrics are)."""
        if self.objective.metrics is None:
            return None
        sums = self._metric_sums
        if sums is None:  # a rank without the loss: its zeros, as long as the loss ranks' sums (one all-reduce)
            sums = torch.zeros(self.model.loss_fn.objective.metric_size, device=self.device)
        sums = sums.detach().double()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(sums)
        return self.objective.metrics(sums)

    def expert_load(self) -> tuple[list[float], float] | None:
        """A mixture-of-experts model's share of the last training step's token assignments per expert (all layers,
        every rank's tokens) and the share of them dropped over capacity, on every rank; None for a dense model.
        One all-reduce over the world: the counts live on the last pipeline stage, the same on each of its TP
        ranks."""
        if not self.config.model.family.moe:
            return None
        counts = self._expert_counts
        counts = (torch.zeros(2, self.config.model.num_local_experts, device=self.device) if counts is None
                  else counts.clone())
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(counts)
        assigned = counts[0].double().sum().clamp(min=1)
        load = counts[0].double() / assigned
        return [round(float(share), 6) for share in load], round(float(counts[1].double().sum() / assigned), 6)

    def fp8_stats(self) -> dict | None:
        """With ``logging.fp8_stats``: per linear kind and cast, each decoder layer's largest amax since the last
        call and its scale (``float8.amax_record``), on every rank; None otherwise. One all-reduce (MAX) over the
        world: each stage holds its layers, each TP rank the amaxes of its shards."""
        if self.config.fp8 is None or not self.config.logging.fp8_stats:
            return None
        table = collect_amax(self.model, self.config.model.num_hidden_layers, self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(table, op=dist.ReduceOp.MAX)
        return amax_record(table, self.config.fp8)

    def grad_norm(self) -> torch.Tensor | float | None:
        """The last step's global gradient norm as the engine holds it (a device tensor is not read here)."""
        norm = self.engine.get_global_grad_norm()
        return self._grad_norm if norm is None else norm

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps DeepSpeed skipped so far (overflow: fp16 loss scaling, ZeRO's and bf16's inf/NaN check)."""
        return int(self.engine.skipped_steps)

    def parameters_finite(self) -> bool:
        """Every parameter of every rank is finite (checked before a save; one all-reduce over the world)."""
        finite = torch.ones((), device=self.device)
        for param in self.model.parameters():
            data = param.ds_tensor if hasattr(param, "ds_tensor") else param.data  # ZeRO-3: this rank's partition
            if data.numel() and not torch.isfinite(data).all():
                finite.zero_()
                break
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(finite, op=dist.ReduceOp.MIN)
        return bool(finite.item())

    def learning_rate(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def _dp_mean(self, value: torch.Tensor) -> torch.Tensor:
        """Mean over DP x CP: each rank's loss is its share scaled by the rank count (the loss rule)."""
        if self.pctx.dp_cp_size > 1:
            dist.all_reduce(value, group=self.pctx.dp_cp_group)
            value = value / self.pctx.dp_cp_size
        return value
