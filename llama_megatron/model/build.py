"""One place that turns configs into a model: plain module for PP=1, PipelineModule for PP>1."""

from __future__ import annotations

import json
from collections.abc import Sequence

from torch import nn

from llama_megatron.config import ModelConfig
from llama_megatron.errors import ConfigError
from llama_megatron.model.init import initialize_weights
from llama_megatron.model.kernels import REFERENCE, Kernels
from llama_megatron.model.llama import LlamaCausalLM, build_pipeline_module
from llama_megatron.model.lora import attach_lora
from llama_megatron.model.lora_layout import LoraConfig
from llama_megatron.model.moe import ExpertGroups, MoEMLP, pack_experts
from llama_megatron.model.moe_section import ExpertCapacity
from llama_megatron.parallel.context import ParallelContext
from llama_megatron.parallel.degrees import ParallelConfig
from llama_megatron.parallel.float8 import Float8Config, attach_float8, check_float8_linears, float8_linears
from llama_megatron.parallel.pipeline_stages import StagePlacement


def build_model(config: ModelConfig, parallel: ParallelConfig, pctx: ParallelContext, seed: int = 1234,
                activation_checkpoint_interval: int = 0, partition_method: str = "type:DecoderLayerPipe",
                initialize: bool = True, kernels: Kernels = REFERENCE, lora: LoraConfig | None = None,
                placement: StagePlacement | None = None, stage_layers: Sequence[int] | None = None,
                fp8: Float8Config | None = None, capacity: ExpertCapacity | None = None) -> nn.Module:
    """This rank's model; ``kernels`` (see :func:`llama_megatron.model.kernels.resolve_kernels`) is the one
    place its operator implementations are chosen. With ``lora`` the base weights are frozen and LoRA adapters
    (seeded, B = 0) sit on the target linears. ``placement`` (PP > 1): the virtual stages of this rank, for the
    schedules our pipeline engine runs (None: DeepSpeed's one block per rank). With ``fp8`` the linears it selects
    compute in float8 (:mod:`llama_megatron.parallel.float8`; a LoRA base's too, its adapters in high precision).
    ``capacity``: a mixture of experts' token dropping (none by default)."""
    shapes = parallel.local_shapes(config)  # derived once; every layer reads its sizes from it
    if pctx.pp_size == 1:
        model: nn.Module = LlamaCausalLM(config, pctx, shapes, activation_checkpoint_interval, kernels)
    else:
        model = build_pipeline_module(config, pctx, shapes, partition_method, activation_checkpoint_interval,
                                      kernels, placement, stage_layers)
    if initialize:
        initialize_weights(model, config, pctx, shapes.padded_vocab_size, seed)
    if lora is not None:
        attach_lora(model, config, lora, pctx, shapes, seed)
    if fp8 is not None:
        attach_float8(model, fp8, pctx.tp_group if pctx.tp_size > 1 else None,
                      pctx.cp_group if pctx.cp_size > 1 else None)
    if capacity is not None:
        for module in model.modules():
            if isinstance(module, MoEMLP):
                module.capacity = capacity
    if config.family.moe is not None and pctx.ep_size > 1 and not any(isinstance(m, MoEMLP) for m in model.modules()):
        model.expert_groups = ExpertGroups(pctx)
    pack_experts(model)
    return model


def selected_float8_linears(config: ModelConfig, fp8: Float8Config) -> list[tuple[str, str, list[int], int]]:
    """The linears ``fp8`` selects (:func:`~llama_megatron.parallel.float8.float8_linears`), read off a model built on
    the meta device (no memory) at TP 1, once per model and section (the planner sizes hundreds of layouts of one
    model)."""
    key = (json.dumps(config.to_dict(), sort_keys=True, default=str), repr(fp8))
    if key not in _FLOAT8_LINEARS:
        import torch

        with torch.device("meta"):
            model = build_model(config, ParallelConfig(make_vocab_size_divisible_by=1), ParallelContext.single(),
                                initialize=False)
        _FLOAT8_LINEARS[key] = float8_linears(model, fp8)
    return _FLOAT8_LINEARS[key]


def check_float8_selection(config: ModelConfig, fp8: Float8Config, tensor: int) -> None:
    """The ``fp8`` section against the model at tensor degree ``tensor``, before anything is built for real."""
    if config.family.latent_attention:  # its linears' FP8 scaling and its layouts are not written yet
        raise ConfigError(f"fp8: the {config.model_type} model's multi-head latent attention does not train in FP8 yet "
                          "(docs/deepseek-v3.md): remove the fp8 section")
    check_float8_linears(selected_float8_linears(config, fp8), fp8, tensor)


_FLOAT8_LINEARS: dict[tuple[str, str], list] = {}
