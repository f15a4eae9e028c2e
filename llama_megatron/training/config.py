"""The training JSON: one file with every section a run needs, validated before any process group exists.

Sections: model (path to a preset / HF config.json, or inline), parallel, data, tokenizer, seq_length,
batch, train, optimizer (with its schedule), eval, checkpoint, logging, activation_checkpointing, pipeline,
distributed, deepspeed_config, kernels, lora (LoRA adapters on a frozen base), seed, output_dir. ``--set a.b=value``
overrides any key (value parsed as JSON when it parses).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any

from llama_megatron.checkpoint.directory import check_tag_name
from llama_megatron.config import ModelConfig
from llama_megatron.data.config import DataConfig, SyntheticData, data_config_from_dict
from llama_megatron.errors import ConfigError
from llama_megatron.model.build import check_float8_selection
from llama_megatron.model.kernels import KERNEL_CHOICES
from llama_megatron.model.lora_layout import LoraConfig, check_targets
from llama_megatron.model.moe_section import ExpertCapacity
from llama_megatron.parallel.degrees import LocalShapes, ParallelConfig
from llama_megatron.parallel.float8 import Float8Config
from llama_megatron.parallel.pipeline_stages import StagePlacement, stage_layers_rule
from llama_megatron.training.config_sections import EvalConfig, read_config_data, typed_section
from llama_megatron.training.objectives import GRPOConfig, PreferenceConfig, check_objective, objective_of
from llama_megatron.training.pipeline.schedules import (
    SCHEDULES,
    micro_batch_rule,
    placement_of,
    schedule_record,
)


@dataclass
class BatchConfig:
    micro_batch_size: int = 1  # samples per micro batch on each data-parallel rank
    global_batch_size: int = 1  # samples per optimizer step; gradient accumulation = global / (micro x DP)

    def accumulation_steps(self, data_parallel: int) -> int:
        """Micro batches per optimizer step on each data-parallel rank (the one place this is computed)."""
        return self.global_batch_size // (self.micro_batch_size * data_parallel)


STOP_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT")


@dataclass
class TrainConfig:
    """How long a run goes and when it stops early (training/faults/guard.py, training/faults/preemption.py)."""

    steps: int = 100  # optimizer steps of the run
    max_minutes: float | None = None   # wall-clock budget: save and exit 0 once a step ends past it
    stop_signals: tuple[str, ...] = ("SIGTERM", "SIGUSR1", "SIGINT")  # finish the step, save, exit 0
    max_bad_steps: int = 3             # stop (exit 3) after this many consecutive bad steps
    loss_spike_factor: float | None = None  # a loss above factor x the mean of the last loss_spike_window good ones is bad
    loss_spike_window: int = 20  # good losses averaged for loss_spike_factor


@dataclass
class OptimizerConfig:
    lr: float = 3e-4  # peak learning rate of AdamW
    min_lr: float = 0.0  # the learning rate the decay ends at
    weight_decay: float = 0.1  # AdamW weight decay (not on norms and biases)
    betas: tuple[float, float] = (0.9, 0.95)  # AdamW betas
    eps: float = 1e-8  # AdamW epsilon
    clip_grad: float = 1.0  # clip the gradient norm (of the whole model) to this; 0: no clipping
    warmup_steps: int = 0  # linear warm-up steps
    decay_style: str = "cosine"  # cosine, linear or constant
    decay_steps: int | None = None  # steps of the decay (default: train.steps - warmup)


AUTO_LOAD = "auto"  # checkpoint.load: resume from checkpoint.save when it holds a checkpoint, else start fresh


@dataclass
class CheckpointConfig:
    save: str | None = None  # the directory checkpoints are saved to
    interval: int = 0  # steps between saves (and one at the last step); 0: no periodic saves
    keep_last: int = 0  # keep the newest saves (by save order, never by clock); 0: all
    # a checkpoint directory to load, or "auto": resume from save if it holds a checkpoint, else start fresh
    load: str | None = None
    tag: str | None = None  # the tag to load (default: the one latest names); a plain name
    finetune: bool = False  # load weights only: step, optimizer and LR schedule reset
    overwrite: bool = False  # start again, replacing checkpoint.save's checkpoints (load auto then resumes nothing)
    verify: str = "checksum"  # what a load checks against each tag's manifest: "checksum" or "size"
    # worker processes of a universal-checkpoint conversion (a resume at another DP x CP or EP degree); 0: twice the
    # cores, at most 8, as many as the host memory for one optimizer file each allows
    universal_workers: int = 0
    # a save stops training only to capture the state; a thread copies it to host memory beside the next step
    # (whose optimizer step waits for the copy) and writes the files, and the tag becomes latest once every rank's
    # are complete (docs/training-loop.md)
    async_save: bool = False


@dataclass
class LoggingConfig:
    interval: int = 1  # steps between log lines (step 1 and the last step are logged too)
    tensorboard_dir: str | None = None  # TensorBoard directory (null: no TensorBoard logs)
    wandb_project: str | None = None  # a Weights & Biases project to log to
    # peak TFLOP/s per device for MFU and HFU (default: the GPU's dense bf16, or FP8, peak from its configs/devices
    # profile; on a CPU this process's measured fp32 matmul rate)
    peak_tflops: float | None = None
    # with fp8: each logged record's per-layer amax and scale of every cast of the FP8 linears (metrics.jsonl "fp8")
    fp8_stats: bool = False


@dataclass
class ActivationCheckpointConfig:
    interval: int = 0  # decoder layers per recomputed span; 0: no recomputation


@dataclass
class PipelineConfig:
    # how layers are split over stages: type:DecoderLayerPipe, uniform or parameters
    partition_method: str = "type:DecoderLayerPipe"
    # "1f1b" (DeepSpeed's engine), "zb-h1" (zero bubble), "interleaved-1f1b" (Megatron's, virtual_stages >= 2) or
    # "zb-v" (zero bubble V, virtual_stages 2): training/pipeline/schedules.py, docs/pipeline-schedules.md
    schedule: str = "1f1b"
    # chunks of the layer list per pipeline rank (virtual stages): 1, or >= 2 for interleaved-1f1b, 2 for zb-v
    virtual_stages: int = 1
    # decoder layers per virtual stage (parallel.pipeline x virtual_stages counts, 0 allowed; the embedding goes
    # with the first, the final norm and head with the last), e.g. fewer on the first and last stages; null: the
    # partition_method's split
    stage_layers: tuple[int, ...] | None = None

    def layer_placement(self, ranks: int) -> dict[str, Any] | None:
        """What decides which layers each of ``ranks`` pipeline ranks holds, for a checkpoint's metadata (None at
        PP 1: one rank holds them all): two runs of one model and PP degree with equal ones place every layer on
        the same rank (1f1b and zb-h1 alike)."""
        if ranks == 1:
            return None
        split = list(self.stage_layers) if self.stage_layers is not None else self.partition_method
        return {"shape": schedule_record(self.schedule).placement, "virtual_stages": self.virtual_stages,
                "split": split}

    def placement(self, ranks: int) -> StagePlacement | None:
        """The virtual stages of the schedules our pipeline engine runs (None: DeepSpeed's engine runs it)."""
        if schedule_record(self.schedule).deepspeed_runs_it:
            return None
        return placement_of(self.schedule, ranks, self.virtual_stages)


@dataclass
class DistributedConfig:
    # no progress on a rank for this long (a stopped rank, a stuck collective): every rank exits 5 with one line
    timeout_minutes: float = 30.0
    # ZeRO-3: build the model partitioned (deepspeed.zero.Init: no rank ever holds it whole) and fill each rank's
    # slices from the seeded tensors or the checkpoint; false builds it whole on every rank first (accelerate's
    # zero3_init_flag)
    zero3_init: bool = True


_SECTIONS = {
    "batch": BatchConfig,
    "train": TrainConfig,
    "optimizer": OptimizerConfig,
    "eval": EvalConfig,
    "checkpoint": CheckpointConfig,
    "logging": LoggingConfig,
    "activation_checkpointing": ActivationCheckpointConfig,
    "pipeline": PipelineConfig,
    "distributed": DistributedConfig,
    "preference": PreferenceConfig,
    "grpo": GRPOConfig,
    "moe": ExpertCapacity,
}


@dataclass
class TrainingConfig:
    # path to a model config / HF config.json (or its directory), the config inline, or {"path": ..., key:
    # value} (the file with keys replaced, e.g. rope_scaling for a longer context)
    model: ModelConfig
    # degrees of parallelism: the `parallel` section below; DP = world / (TP x PP x CP)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    # the training data, typed by `type`: pretrain, sft or synthetic (the `data` sections below; docs/data.md)
    data: DataConfig = field(default_factory=SyntheticData)
    # tokenizer.model or an HF tokenizer directory; checked against the model vocab at start
    tokenizer: str | None = None
    seq_length: int = 128  # tokens per sample
    batch: BatchConfig = field(default_factory=BatchConfig)  # batch sizes: the `batch` section below
    # run length and early stops: the `train` section below
    train: TrainConfig = field(default_factory=TrainConfig)
    # AdamW and its LR schedule: the `optimizer` section below
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)  # validation: the `eval` section below
    # saving, loading and resuming: the `checkpoint` section below
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    # log lines, TensorBoard, W&B, MFU peak: the `logging` section below
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    # activation recomputation: the `activation_checkpointing` section below
    activation_checkpointing: ActivationCheckpointConfig = field(default_factory=ActivationCheckpointConfig)
    # pipeline partitioning and schedule: the `pipeline` section below
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    # stall timeout and ZeRO-3 construction: the `distributed` section below
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    # the loss of preference pairs (data.type preference): the `preference` section below
    preference: PreferenceConfig = field(default_factory=PreferenceConfig)
    # online RL over prompts (data.type prompts): the `grpo` section below
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    # a ds_configs/*.json path or an inline object; no optimizer/scheduler sections, batch keys only when they
    # agree
    deepspeed_config: str | dict | None = None
    # auto (compiled on CUDA, reference elsewhere), reference, compiled or liger (docs/kernels-and-gpu.md)
    kernels: str = "auto"
    # LoRA adapters on a frozen base: the `lora` section below (null: full training)
    lora: LoraConfig | None = None
    # FP8 training with torchao's float8 recipes: {"recipe": tensorwise | rowwise | rowwise_with_gw_hp, "modules":
    # [...], "filter": [...], "emulate": false} (null: off; docs/fp8.md)
    fp8: Float8Config | None = None
    # a mixture of experts' token dropping: the `moe` section below (docs/moe.md)
    moe: ExpertCapacity = field(default_factory=ExpertCapacity)
    seed: int = 1234  # seed of initialisation, data order and dropout
    output_dir: str = "runs/default"  # run.json, metrics.jsonl and doctor.json go here

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainingConfig:
        data = dict(data)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ConfigError(f"unknown training config keys: {', '.join(sorted(unknown))}")
        if "model" not in data:
            raise ConfigError("training config needs a 'model' section (a config path or an inline object)")
        kwargs: dict[str, Any] = {"model": model_config(data.pop("model"))}
        if "parallel" in data:
            kwargs["parallel"] = ParallelConfig.from_dict(data.pop("parallel"))
        if "data" in data:
            kwargs["data"] = data_config_from_dict(data.pop("data"))
        for name, section_cls in _SECTIONS.items():
            if name in data:
                kwargs[name] = typed_section(section_cls, name, data.pop(name))
        if data.get("lora") is not None:
            kwargs["lora"] = LoraConfig.from_dict(data.pop("lora"))
        if data.get("fp8") is not None:
            kwargs["fp8"] = Float8Config.from_dict(data.pop("fp8"))
        kwargs.update(data)
        config = cls(**kwargs)
        config.validate()
        return config

    @classmethod
    def from_file(cls, path: str, overrides: list[str] | None = None) -> TrainingConfig:
        return cls.from_dict(read_config_data(path, overrides))

    def validate(self) -> None:
        """Everything that does not depend on the world size; run once, when the config is read."""
        if self.fp8 is not None:
            check_float8_selection(self.model, self.fp8, self.parallel.tensor)
        elif self.logging.fp8_stats:
            raise ConfigError("logging.fp8_stats reports the FP8 linears' amaxes, and this run has no fp8 section")
        self.moe.check()
        if self.moe.capacity_factor is not None and not self.model.family.moe:
            raise ConfigError(f"moe.capacity_factor drops a mixture of experts' assignments, and the "
                              f"{self.model.model_type} model has no experts")
        if self.kernels not in KERNEL_CHOICES:
            raise ConfigError(f"kernels {self.kernels!r} is not one of {', '.join(KERNEL_CHOICES)}")
        if not isinstance(self.seq_length, int) or self.seq_length < 1:
            raise ConfigError(f"seq_length must be a positive integer, got {self.seq_length!r}")
        self.parallel.validate(self.model)
        self.parallel.check_seq_length(self.seq_length)
        b = self.batch
        if b.micro_batch_size < 1 or b.global_batch_size < 1:
            raise ConfigError("batch.micro_batch_size and batch.global_batch_size must be >= 1")
        self._validate_train()
        opt = self.optimizer
        if opt.decay_style not in ("cosine", "linear", "constant"):
            raise ConfigError(f"optimizer.decay_style {opt.decay_style!r}: choose cosine, linear or constant")
        if not 0 <= opt.min_lr <= opt.lr:
            raise ConfigError(f"optimizer.min_lr {opt.min_lr} must lie in [0, lr={opt.lr}]")
        if opt.warmup_steps < 0 or opt.clip_grad < 0:
            raise ConfigError("optimizer.warmup_steps and optimizer.clip_grad must be >= 0")
        ckpt = self.checkpoint
        if ckpt.interval and not ckpt.save:
            raise ConfigError("checkpoint.interval is set but checkpoint.save (a directory) is not")
        if ckpt.load == AUTO_LOAD:
            if not ckpt.save:
                raise ConfigError('checkpoint.load "auto" resumes from checkpoint.save, which is not set')
            if ckpt.finetune or ckpt.tag:
                raise ConfigError('checkpoint.load "auto" resumes the latest checkpoint in checkpoint.save: it '
                                  "takes no checkpoint.tag and no checkpoint.finetune (name the directory to load)")
        self.eval.check()
        if self.logging.interval < 1:
            raise ConfigError(f"logging.interval must be >= 1 (steps between log lines), got {self.logging.interval}")
        if ckpt.keep_last < 0 or ckpt.interval < 0 or ckpt.universal_workers < 0:
            raise ConfigError("checkpoint.interval, checkpoint.keep_last and checkpoint.universal_workers must be >= 0")
        if ckpt.verify not in ("checksum", "size"):
            raise ConfigError(f"checkpoint.verify {ckpt.verify!r}: choose checksum or size")
        for key in ("tag", "load", "save"):
            value = getattr(ckpt, key)
            if value is not None and not value:
                raise ConfigError(f"checkpoint.{key} is empty")
        if ckpt.tag is not None:
            check_tag_name(ckpt.tag, "checkpoint.tag")
        if self.pipeline.schedule not in SCHEDULES:
            raise ConfigError(f"pipeline.schedule {self.pipeline.schedule!r} is not one of {', '.join(SCHEDULES)}")
        self._validate_pipeline()
        if not self.distributed.timeout_minutes > 0:
            raise ConfigError(f"distributed.timeout_minutes must be > 0, got {self.distributed.timeout_minutes}")
        self._validate_experts()
        check_objective(self)

    @property
    def rows_per_sample(self) -> int:
        """Rows of seq_length tokens a sample of the data takes (its objective's: a padded preference pair is two)."""
        return objective_of(self).rows_per_sample(self)

    def _validate_experts(self) -> None:
        """LoRA targets that fit the model's MLP."""
        if self.lora is not None:
            check_targets(self.model, self.lora)

    def _validate_pipeline(self) -> None:
        """The schedule, its virtual stages and their split of the layers (the micro-batch count is checked
        where the world size is known: :meth:`check_world_size`)."""
        pipe, ranks = self.pipeline, self.parallel.pipeline
        record = schedule_record(pipe.schedule)
        if record.needs_pipeline and ranks == 1:
            raise ConfigError(f"pipeline.schedule {pipe.schedule!r} schedules pipeline stages: it needs "
                              "parallel.pipeline > 1")
        why = record.chunks_rule(pipe.virtual_stages)
        if why is not None:
            raise ConfigError(why)
        stages = ranks * pipe.virtual_stages
        if pipe.stage_layers is not None:
            if record.deepspeed_runs_it:
                raise ConfigError("pipeline.stage_layers places layers on the virtual stages of our engine's "
                                  f"schedules: DeepSpeed's {pipe.schedule} takes pipeline.partition_method")
            why = stage_layers_rule(pipe.stage_layers, stages, self.model.num_hidden_layers)
            if why is not None:
                raise ConfigError(why)
        elif stages > self.model.num_hidden_layers:
            raise ConfigError(f"{stages} virtual stages (parallel.pipeline {ranks} x pipeline.virtual_stages "
                              f"{pipe.virtual_stages}) exceed num_hidden_layers {self.model.num_hidden_layers}")

    def _validate_train(self) -> None:
        train = self.train
        if train.steps < 1:
            raise ConfigError(f"train.steps must be >= 1, got {train.steps}")
        if train.max_minutes is not None and train.max_minutes <= 0:
            raise ConfigError(f"train.max_minutes must be > 0 (or null), got {train.max_minutes}")
        if train.max_bad_steps < 1:
            raise ConfigError(f"train.max_bad_steps must be >= 1, got {train.max_bad_steps}")
        if train.loss_spike_factor is not None and train.loss_spike_factor <= 1:
            raise ConfigError(f"train.loss_spike_factor must be > 1 (or null), got {train.loss_spike_factor}")
        if train.loss_spike_window < 1:
            raise ConfigError(f"train.loss_spike_window must be >= 1, got {train.loss_spike_window}")
        unknown = [name for name in train.stop_signals if name not in STOP_SIGNALS]
        if unknown:
            raise ConfigError(f"train.stop_signals: {unknown[0]!r} is not one of {', '.join(STOP_SIGNALS)}")

    def check_world_size(self, world_size: int) -> None:
        """What the launch adds to :meth:`validate`: TP x PP divides the world, the batch divides over DP, and
        the pipeline schedule can run the micro batches of a step."""
        self.parallel.check_world_size(world_size)
        b, dp = self.batch, self.data_parallel_size(world_size)
        if b.global_batch_size % (b.micro_batch_size * dp):
            raise ConfigError(
                f"batch.global_batch_size {b.global_batch_size} is not divisible by micro_batch_size "
                f"{b.micro_batch_size} x data parallel {dp}"
            )
        if self.parallel.pipeline > 1:  # the pipeline schedule can run this many micro batches per step
            why = micro_batch_rule(self.pipeline.schedule, self.parallel.pipeline, self.pipeline.virtual_stages,
                                   self.gradient_accumulation_steps(world_size))
            if why is not None:
                raise ConfigError(f"pipeline.schedule {self.pipeline.schedule!r}: {why}")

    def data_parallel_size(self, world_size: int) -> int:
        return self.parallel.data_parallel_size(world_size)

    @property
    def local_shapes(self) -> LocalShapes:
        """One rank's share of the model under this run's degrees (padded vocabulary, heads, rows)."""
        return self.parallel.local_shapes(self.model)

    def gradient_accumulation_steps(self, world_size: int) -> int:
        return self.batch.accumulation_steps(self.data_parallel_size(world_size))

    def num_eval_runs(self) -> int:
        return 0 if not self.eval.interval else math.ceil(self.train.steps / self.eval.interval) + 1

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["data"] = self.data.to_dict()
        out["lora"] = self.lora.to_dict() if self.lora else None
        return out

    def run_record(self, start: str | None) -> dict[str, Any]:
        """What makes two runs one, as each checkpoint records it (``llama_megatron.json``'s ``run``): what is
        trained (model, data, tokenizer, sequence length, global batch, optimizer and LR schedule, adapters,
        preference loss, seed) and from where (``start``: the checkpoint the run's first step started from, weights
        only; None from a seeded init). Not how long (a larger ``train.steps`` continues the same run), nor the
        layout, evaluation, logging or saving. As JSON reads it back (lists, not tuples), so records compare."""
        whole = self.to_dict()
        trained = {key: whole[key] for key in ("model", "data", "tokenizer", "seq_length", "optimizer", "lora",
                                               "preference", "seed")}
        trained["batch"] = {"global_batch_size": self.batch.global_batch_size}
        return json.loads(json.dumps({"config": trained, "start": start}))


def model_config(value: Any) -> ModelConfig:
    """The ``model`` section: a path (a preset, an HF ``config.json`` or its directory), the config inline, or
    ``{"path": ..., key: value, ...}``: the file with some keys replaced, e.g. a longer ``max_position_embeddings``
    and a ``rope_scaling`` when a converted checkpoint is fine-tuned to a longer context."""
    if isinstance(value, str):
        return ModelConfig.from_file(value)
    if not isinstance(value, dict):
        raise ConfigError("the 'model' section must be a config path or an object")
    if "path" not in value:
        return ModelConfig.from_dict(value)
    overrides = dict(value)
    path = overrides.pop("path")
    if not isinstance(path, str):
        raise ConfigError(f"model.path must be a config path, got {path!r}")
    return ModelConfig.from_dict({**ModelConfig.from_file(path).to_dict(), **overrides})
