"""DeepSpeed's engines made aware of our mixture-of-experts layers, and the whole model's gradient norm.

DeepSpeed runs its expert-parallel machinery (experts' gradients averaged over their expert-data-parallel group,
ZeRO partitions of the experts over that group, the experts' broadcast from its first rank) only when its engine
finds an MoE layer, which it recognises by class (its own ``MoE`` or ``AutoEPMoELayer``). Our layers are neither:
DeepSpeed's gate differs from HF's routing (:mod:`llama_megatron.model.moe`) and its checkpoint code assumes its
own module names. :class:`ExpertLayers` tells the engine about ours instead; DeepSpeed then calls their
``set_deepspeed_parallelism`` (which registers the expert groups, checked equal to ours) and reads the marks on
the expert parameters (``allreduce = False``, ``group_name``). At EP 1 nothing is marked and the experts are
ordinary replicated weights.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from deepspeed.moe.utils import is_moe_param
from deepspeed.runtime.engine import DeepSpeedEngine

from llama_megatron.model.moe import MoEMLP
from llama_megatron.parallel.context import ParallelContext


def global_grad_norm(parameters, pctx: ParallelContext, device: torch.device) -> torch.Tensor:
    """L2 norm of every gradient of the model, as one process holding all of it computes it: TP shards summed over
    the TP group, a replicated tensor counted once (each TP rank holds all of it), a tied table held by two stages
    counted on the first (DeepSpeed marks the other copy ``ds_pipe_replicated``), the experts of every EP rank
    (TP shards too) summed over the EP group, and the stages summed."""
    sharded = torch.zeros(2, device=device, dtype=torch.float64)  # TP shards: [dense, experts]
    replicated = torch.zeros((), device=device, dtype=torch.float64)
    for param in parameters:
        if param.grad is None or getattr(param, "ds_pipe_replicated", False):
            continue
        squares = param.grad.detach().double().pow(2).sum()
        if is_moe_param(param):
            sharded[1] += squares
        elif getattr(param, "tensor_model_parallel", False):
            sharded[0] += squares
        else:
            replicated += squares
    if pctx.tp_size > 1:
        dist.all_reduce(sharded, group=pctx.tp_group)
    if pctx.ep_size > 1:
        dist.all_reduce(sharded[1:], group=pctx.ep_group)
    total = sharded.sum() + replicated
    if pctx.pp_size > 1:
        dist.all_reduce(total, group=pctx.pp_group)
    return total.sqrt()


class ExpertLayers:
    """Engine mixin: our expert-parallel MoE layers count as DeepSpeed MoE layers, and fp32 gradient clipping can
    use the whole model's norm (:func:`global_grad_norm`)."""

    pctx: ParallelContext  # set by the initialise function

    def _set_client_model(self, model: torch.nn.Module) -> None:
        super()._set_client_model(model)
        layers = [m for m in model.modules() if isinstance(m, MoEMLP) and m.pctx.ep_size > 1]
        if layers:
            self.has_moe_layers = True
            self.num_experts.extend(layer.num_experts for layer in layers)

    def clip_by_global_norm(self) -> None:
        norm = global_grad_norm(self.module.parameters(), self.pctx, self.device)
        self._global_grad_norm = norm  # what get_global_grad_norm() reports for the step
        clip = self.gradient_clipping() / (norm.float() + 1e-6)  # DeepSpeed's clip_grad_norm_ rule
        if clip < 1:
            for param in self.module.parameters():
                if param.grad is not None:
                    param.grad.detach().mul_(clip.to(param.grad.dtype))


class LlamaEngine(ExpertLayers, DeepSpeedEngine):
    """DeepSpeed's engine for PP 1. With expert parallelism its plain fp32 clipping uses the whole model's norm
    (DeepSpeed's averages the ranks' norms, each over its own experts); otherwise it is DeepSpeed's."""

    def clip_fp32_gradients(self) -> None:
        if self.has_moe_layers:
            self.clip_by_global_norm()
        else:
            super().clip_fp32_gradients()


def initialize_engine(model: torch.nn.Module, optimizer, lr_scheduler, config: dict, pctx: ParallelContext):
    """``deepspeed.initialize`` for a plain module with :class:`LlamaEngine`: the same steps (DeepSpeed's config
    object, optimizer flags, the engine) with our class."""
    import deepspeed
    from deepspeed.runtime.config import DeepSpeedConfig

    deepspeed.zero.partition_parameters.shutdown_init_context()
    config_class = DeepSpeedConfig(config, pctx)
    deepspeed.set_optimizer_flags(config_class, model)
    engine = LlamaEngine(args=None, model=model, optimizer=optimizer, model_parameters=None, training_data=None,
                         lr_scheduler=lr_scheduler, mpu=pctx, dist_init_required=False, collate_fn=None,
                         config=config, config_class=config_class)
    engine.pctx = pctx
    deepspeed.zero.partition_parameters.restore_init_context()
    engine._configure_python_gc()
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler
