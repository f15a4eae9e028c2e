"""DeepSpeed's engines made aware of our mixture-of-experts layers, and the whole model's gradient norm.

DeepSpeed runs its expert-parallel machinery (experts' gradients averaged over their expert-data-parallel group,
ZeRO partitions of the experts over that group, the experts' broadcast from its first rank) only when its engine
finds an MoE layer, which it recognises by class (its own ``MoE`` or ``AutoEPMoELayer``). Our layers are neither:
DeepSpeed's gate differs from HF's routing (:mod:`llama_megatron.model.moe`) and its checkpoint code assumes its
own module names. :class:`ExpertLayers` tells the engine about ours instead; DeepSpeed then calls their
``set_deepspeed_parallelism`` (which registers the expert groups, checked equal to ours) and reads the marks on
the expert parameters (``allreduce = False``, ``group_name``). At EP 1 nothing is marked and the experts are
ordinary replicated weights.

Checkpoints at EP > 1 take DeepSpeed's dense path (its MoE path saves only its own MoE classes' experts, and writes a
pipeline stage's weights into ``mp_rank`` files its pipeline loader does not read): the layer / module files and the
ZeRO files as for any run, the experts left out of the former, and each expert in a file of its own
(checkpoint/weights.py), written by the first rank of its expert-data-parallel group. ZeRO's files hold each rank's
partitions of its expert groups, so a resume with the same degrees restores every expert's optimizer state; one at
another EP or DP x CP degree goes through a universal checkpoint whose merge takes in every rank's experts
(checkpoint/universal/experts.py), cut by DeepSpeed's loader for the new expert-data-parallel groups.
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch
import torch.distributed as dist
from deepspeed.moe.utils import is_moe_param
from deepspeed.runtime.engine import DeepSpeedEngine

from llama_megatron.checkpoint.safe_load import load_state_file
from llama_megatron.checkpoint.weights import expert_file
from llama_megatron.model.moe import MoEMLP
from llama_megatron.parallel.context import ParallelContext
from llama_megatron.training.engine.step_fence import ModelStepFence


def global_grad_norm(parameters, pctx: ParallelContext, device: torch.device) -> torch.Tensor:
    """L2 norm of every gradient of the model, as one process holding all of it computes it: TP shards summed over
    the TP group, a replicated tensor counted once (each TP rank holds all of it), a tied table held by two stages
    counted on the first (DeepSpeed marks the other copy ``ds_pipe_replicated``), the experts of every EP rank
    (their TP shards summed over TP, their replicated LoRA matrices not) summed over the EP group, and the stages
    summed."""
    sharded = torch.zeros(2, device=device, dtype=torch.float64)  # TP shards: [dense, experts]
    replicated = torch.zeros(2, device=device, dtype=torch.float64)  # [dense, experts]
    for param in parameters:
        if param.grad is None or getattr(param, "ds_pipe_replicated", False):
            continue
        squares = param.grad.detach().double().pow(2).sum()
        bucket = sharded if getattr(param, "tensor_model_parallel", False) else replicated
        bucket[1 if is_moe_param(param) else 0] += squares
    if pctx.tp_size > 1:
        dist.all_reduce(sharded, group=pctx.tp_group)
    experts = sharded[1] + replicated[1]
    if pctx.ep_size > 1:
        dist.all_reduce(experts, group=pctx.ep_group)
    total = sharded[0] + replicated[0] + experts
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
        # (a pipeline stage without MoE blocks stays dense to DeepSpeed, whose ZeRO wants an experts' parameter group
        # then; it joins the expert groups' forming through model/moe.py's ExpertGroups, and the pipeline engine
        # clips every stage by the whole model's norm)
        if layers:
            self.has_moe_layers = True
            self.num_experts.extend(layer.num_experts for layer in layers)

    def save_checkpoint(self, save_dir, tag=None, client_state={}, save_latest=True,  # noqa: B006 (DeepSpeed's)
                        exclude_frozen_parameters=False):
        if not self.has_moe_layers:
            return super().save_checkpoint(save_dir, tag, client_state, save_latest, exclude_frozen_parameters)
        tag = f"global_step{self.global_steps}" if tag is None else str(tag)
        with self._experts_apart():
            saved = super().save_checkpoint(save_dir, tag, client_state, save_latest, exclude_frozen_parameters)
        if self.pctx.rank == self.pctx.edp_group_ranks[0]:
            # cloned: a bf16 optimizer's parameters are views of one flat buffer, which torch.save would write whole
            # (unless the checkpoint engine copies each tensor on its own: an asynchronous save's)
            clone = self.checkpoint_engine.preserves_storage_sharing()
            for layer, within, module in self._moe_blocks():
                for expert, mlp in module.experts.items():
                    # a LoRA run saves the adapters only (DeepSpeed's exclude_frozen_parameters)
                    frozen = {n for n, p in mlp.named_parameters() if not p.requires_grad}
                    state = {f"{within}.experts.{expert}.{key}": value.detach().clone() if clone else value.detach()
                             for key, value in mlp.state_dict().items()
                             if not (exclude_frozen_parameters and key in frozen)}
                    # through the checkpoint engine, as DeepSpeed's own files: an asynchronous save copies them to
                    # host memory and writes them in the background with the rest
                    self.checkpoint_engine.save(state, expert_file(os.path.join(save_dir, tag), layer, int(expert),
                                                                   self.pctx.tp_rank))
        return saved

    def load_checkpoint(self, load_dir, tag=None, **kwargs):
        if not self.has_moe_layers:
            return super().load_checkpoint(load_dir, tag, **kwargs)
        with self._experts_apart(os.path.join(load_dir, tag)):
            return super().load_checkpoint(load_dir, tag, **kwargs)

    def _moe_blocks(self) -> list[tuple[int, str, MoEMLP]]:
        """(pipeline layer index, name inside the layer, block) of each MoE block this rank holds: the model registers
        its layers by index, as PipelineModule does (``3.mlp``)."""
        return [(int(name.split(".", 1)[0]), name.split(".", 1)[1], module)
                for name, module in self.module.named_modules() if isinstance(module, MoEMLP)]

    @contextlib.contextmanager
    def _experts_apart(self, load_from: str | None = None):
        """DeepSpeed's dense checkpoint path, with the experts left out of the state dicts it saves, or (loading
        ``load_from``) put into the ones it loads from their files."""
        handles = []
        for layer, within, module in self._moe_blocks():
            if load_from is None:
                handles.append(module.register_state_dict_post_hook(_drop_experts))
            else:
                add = functools.partial(_add_experts, tag_dir=load_from, layer=layer, within=within,
                                        tp_rank=self.pctx.tp_rank)
                handles.append(module.register_load_state_dict_pre_hook(add))
        self.has_moe_layers = False
        try:
            yield
        finally:
            self.has_moe_layers = True
            for handle in handles:
                handle.remove()

    def clip_by_global_norm(self) -> None:
        norm = global_grad_norm(self.module.parameters(), self.pctx, self.device)
        self._global_grad_norm = norm  # what get_global_grad_norm() reports for the step
        clip = self.gradient_clipping() / (norm.float() + 1e-6)  # DeepSpeed's clip_grad_norm_ rule
        if clip < 1:
            for param in self.module.parameters():
                if param.grad is not None:
                    param.grad.detach().mul_(clip.to(param.grad.dtype))


def _drop_experts(module: MoEMLP, state: dict, prefix: str, local_metadata: dict) -> None:
    for key in [k for k in state if k.startswith(prefix + "experts.")]:
        del state[key]


def _add_experts(module: MoEMLP, state: dict, prefix: str, *hook_args, tag_dir: str, layer: int, within: str,
                 tp_rank: int) -> None:
    for expert in module.experts:
        saved = load_state_file(expert_file(tag_dir, layer, int(expert), tp_rank))
        state.update({prefix + key.removeprefix(within + "."): value for key, value in saved.items()})


class LlamaEngine(ModelStepFence, ExpertLayers, DeepSpeedEngine):
    """DeepSpeed's engine for PP 1. With expert parallelism its plain fp32 clipping uses the whole model's norm
    (DeepSpeed's averages the ranks' norms, each over its own experts); otherwise it is DeepSpeed's."""

    def clip_fp32_gradients(self) -> None:
        if self.has_moe_layers:
            self.clip_by_global_norm()
        else:
            super().clip_fp32_gradients()


def construct_engine(engine_class: type[DeepSpeedEngine], model: torch.nn.Module, optimizer, lr_scheduler,
                     config: dict, mpu, pctx: ParallelContext):
    """What ``deepspeed.initialize`` does (DeepSpeed's config object from ``mpu``'s topology, optimizer flags, the
    engine), with ``engine_class`` one of ours; returns ``deepspeed.initialize``'s four values."""
    import deepspeed
    from deepspeed.runtime.config import DeepSpeedConfig

    deepspeed.zero.partition_parameters.shutdown_init_context()
    config_class = DeepSpeedConfig(config, mpu)
    deepspeed.set_optimizer_flags(config_class, model)
    engine = engine_class(args=None, model=model, optimizer=optimizer, model_parameters=None, training_data=None,
                          lr_scheduler=lr_scheduler, mpu=mpu, dist_init_required=False, collate_fn=None,
                          config=config, config_class=config_class)
    engine.pctx = pctx
    deepspeed.zero.partition_parameters.restore_init_context()
    engine._configure_python_gc()
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler


def initialize_engine(model: torch.nn.Module, optimizer, lr_scheduler, config: dict, pctx: ParallelContext):
    """``deepspeed.initialize`` for a plain module with :class:`LlamaEngine`."""
    return construct_engine(LlamaEngine, model, optimizer, lr_scheduler, config, pctx, pctx)
