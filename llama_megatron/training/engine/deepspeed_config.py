"""Build the DeepSpeed JSON for a run: the named file plus what the training config owns.

The training config is the single source of truth for batch sizes and gradient clipping: DeepSpeed keys that
repeat them are allowed only when they agree. Combinations DeepSpeed would reject deep inside its engine
(ZeRO-2/3 with pipeline parallelism, fp16 on a CPU), or on which it would hang (ZeRO-1 at PP > 1 with parameter
groups that differ between stages), are refused here with one line.
"""

from __future__ import annotations

import copy
from typing import Any

from llama_megatron.config import read_json
from llama_megatron.errors import ConfigError
from llama_megatron.model.lora_layout import trains_final_norm_alone
from llama_megatron.training.config import TrainingConfig
from llama_megatron.training.pipeline.schedules import schedule_record


def load_deepspeed_json(source: str | dict | None) -> dict[str, Any]:
    if source is None:
        return {}
    if isinstance(source, dict):
        return copy.deepcopy(source)
    return read_json(source, "DeepSpeed config")


def zero_stage(ds: dict[str, Any]) -> int:
    return int(ds.get("zero_optimization", {}).get("stage", 0))


def precision(ds: dict[str, Any]) -> str:
    if ds.get("bf16", {}).get("enabled"):
        return "bf16"
    if ds.get("fp16", {}).get("enabled"):
        return "fp16"
    return "fp32"


def build_deepspeed_config(config: TrainingConfig, ds_source: str | dict | None, world_size: int,
                           accelerator: str = "cpu") -> dict[str, Any]:
    ds = load_deepspeed_json(ds_source)
    for owned in ("optimizer", "scheduler"):
        if owned in ds:
            raise ConfigError(
                f"DeepSpeed config has an {owned!r} section; the training config's 'optimizer' section owns it"
            )
    pp = config.parallel.pipeline
    stage = zero_stage(ds)
    if pp > 1 and stage >= 2:
        raise ConfigError(
            f"ZeRO stage {stage} cannot be combined with pipeline parallelism (pipeline={pp}): "
            "use ZeRO-0/1 with PP, or pipeline=1 with ZeRO-2/3"
        )
    if pp > 1 and stage == 1 and precision(ds) != "bf16" and config.lora and trains_final_norm_alone(config.model,
                                                                                                   config.lora):
        # DeepSpeed's ZeRO-1/2 optimizer all-reduces each parameter group's gradient norm over the model-parallel
        # group, which spans the stages: with a group more on the last stage the others never join (a hang)
        raise ConfigError("lora.modules_to_save trains the final norm (no weight decay: a parameter group of its own) "
                          f"on the last pipeline stage only, and ZeRO-1 at pipeline={pp} needs the same parameter "
                          "groups on every stage: train the layers' norms too (norm, input_layernorm or "
                          "post_attention_layernorm), or use ZeRO-0 or bf16")
    if stage == 3 and config.parallel.expert > 1:
        raise ConfigError(f"ZeRO stage 3 cannot be combined with expert parallelism (expert={config.parallel.expert}): "
                          "DeepSpeed partitions only its own AutoEP experts under ZeRO-3; use ZeRO-1/2")
    resumes = config.checkpoint.load and not config.checkpoint.finetune
    if stage == 0 and config.parallel.expert > 1 and (config.checkpoint.save or resumes):
        raise ConfigError(f"checkpoints of an expert-parallel run (expert={config.parallel.expert}) need ZeRO-1/2: "
                          "under ZeRO-0 DeepSpeed saves the optimizer state of data-parallel rank 0 only, which holds "
                          "one EP rank's experts")
    if precision(ds) == "fp16" and accelerator == "cpu":
        raise ConfigError("fp16 is not supported on CPU; use a bf16 or fp32 DeepSpeed config")

    micro = config.batch.micro_batch_size
    accum = config.gradient_accumulation_steps(world_size)
    expected = {
        # DeepSpeed's data-parallel group is DP x CP (parallel/context.py): it counts each context rank's sequence
        # shard of a sample as a sample of its own
        "train_batch_size": config.batch.global_batch_size * config.parallel.context,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accum,
        "gradient_clipping": config.optimizer.clip_grad,
    }
    for key, value in expected.items():
        if key in ds and ds[key] not in ("auto", value):
            raise ConfigError(
                f"DeepSpeed config {key}={ds[key]} disagrees with the training config ({value}); "
                "set it in one place (the training config)"
            )
        ds[key] = value
    ds.setdefault("steps_per_print", 10**9)
    ds.setdefault("wall_clock_breakdown", False)
    if precision(ds) == "bf16" and pp > 1:
        # bf16 gradients accumulated over micro batches drift; keep the accumulation in fp32 under PP.
        ds.setdefault("data_types", {}).setdefault("grad_accum_dtype", "fp32")
    ours = not schedule_record(config.pipeline.schedule).deepspeed_runs_it
    if pp > 1 and (config.parallel.sequence_parallel or ours or config.model.family.moe):
        # our engine's schedules (training/engine/pipeline_engine.py) send each rank's payload whole too, and so does
        # an MoE model (the engine's single backward over several sent tensors does not rebuild partitioned ones)
        _unpartitioned_pipe_payloads(ds)
    return ds


def _unpartitioned_pipe_payloads(ds: dict[str, Any]) -> None:
    """Sequence parallelism under PP: DeepSpeed must send each TP rank's own activation between stages.

    With TP>1 DeepSpeed's pipeline engine by default cuts the stage output into TP pieces, sends one piece per
    TP rank and all-gathers them on the next stage (``pipe_partitioned``; ``grad_partitioned`` for the
    gradients coming back). That assumes every TP rank holds the same activation. Under sequence parallelism
    each TP rank holds a different sequence shard, so the reassembled tensor mixes the shards of different
    ranks: a different model, silently. The shard is already 1/TP of the activation, so sending it whole costs
    the same bytes as the partitioned send and saves the all-gather.
    """
    pipeline = ds.setdefault("pipeline", {})
    for key in ("pipe_partitioned", "grad_partitioned"):
        if pipeline.get(key, False) is not False:
            raise ConfigError(
                f"DeepSpeed config pipeline.{key}={pipeline[key]!r} cannot be combined with sequence_parallel "
                "(each TP rank holds a different sequence shard), a pipeline.schedule other than 1f1b (our engine's sends) or "
                "a mixture-of-experts model (router statistics sent with the hidden states) under pipeline "
                "parallelism: remove the key"
            )
        pipeline[key] = False
