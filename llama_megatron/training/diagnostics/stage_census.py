"""What each pipeline rank holds, counted from the layout the memory estimate derives (its virtual stages): the
MoE layers per rank (expert parallelism under ZeRO needs one on each: training/run/setup.py) and the decoder layers
recomputation repeats (hardware FLOPs: training/diagnostics/flops.py)."""

from __future__ import annotations

from llama_megatron.training.config import TrainingConfig
from llama_megatron.training.diagnostics.activation_bytes import checkpoint_spans
from llama_megatron.training.diagnostics.memory_estimate import stage_layer_kinds, virtual_stages


def recomputed_decoder_layers(config: TrainingConfig) -> int:
    """Decoder layers whose forward the backward repeats (the recomputed spans of every virtual stage)."""
    interval = config.activation_checkpointing.interval
    if not interval:
        return 0
    pipelined = config.parallel.pipeline > 1
    return sum(count for kinds in stage_layer_kinds(config)
               for count, recomputed in checkpoint_spans(kinds, interval, pipelined) if recomputed)


def moe_layers_per_pipeline_rank(config: TrainingConfig) -> list[int]:
    """How many MoE decoder layers each pipeline rank holds (over its virtual stages)."""
    stages, placement = virtual_stages(config)
    return [sum(1 for c in range(placement.chunks) for layer in stages[placement.stage(rank, c)] if layer.experts)
            for rank in range(config.parallel.pipeline)]
