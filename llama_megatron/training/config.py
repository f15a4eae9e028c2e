"""The training JSON: one file with every section a run needs, validated before any process group exists.

Sections: model (path to a preset / HF config.json, or inline), parallel, data, tokenizer, seq_length,
batch, train, optimizer (with its schedule), eval, checkpoint, logging, activation_checkpointing, pipeline,
deepspeed_config, kernels, lora (LoRA adapters on a frozen base), seed, output_dir. ``--set a.b=value`` overrides
any key (value parsed as JSON when it parses).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any

from llama_megatron.config import ModelConfig, ParallelConfig, read_json
from llama_megatron.data.config import DataConfig, SyntheticData, data_config_from_dict
from llama_megatron.errors import ConfigError
from llama_megatron.model.kernels import KERNEL_CHOICES
from llama_megatron.model.lora_layout import LoraConfig


@dataclass
class BatchConfig:
    micro_batch_size: int = 1
    global_batch_size: int = 1

    def accumulation_steps(self, data_parallel: int) -> int:
        """Micro batches per optimizer step on each data-parallel rank (the one place this is computed)."""
        return self.global_batch_size // (self.micro_batch_size * data_parallel)


@dataclass
class TrainLengthConfig:
    steps: int = 100


@dataclass
class OptimizerConfig:
    lr: float = 3e-4
    min_lr: float = 0.0
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    clip_grad: float = 1.0
    warmup_steps: int = 0
    decay_style: str = "cosine"
    decay_steps: int | None = None


@dataclass
class EvalConfig:
    interval: int = 0
    iters: int = 1


AUTO_LOAD = "auto"  # checkpoint.load: resume from checkpoint.save when it holds a checkpoint, else start fresh


@dataclass
class CheckpointConfig:
    save: str | None = None
    interval: int = 0
    keep_last: int = 0
    load: str | None = None
    tag: str | None = None
    finetune: bool = False


@dataclass
class LoggingConfig:
    interval: int = 1
    tensorboard_dir: str | None = None
    wandb_project: str | None = None
    peak_tflops: float | None = None


@dataclass
class ActivationCheckpointConfig:
    interval: int = 0


@dataclass
class PipelineConfig:
    partition_method: str = "type:DecoderLayerPipe"


_SECTIONS = {
    "batch": BatchConfig,
    "train": TrainLengthConfig,
    "optimizer": OptimizerConfig,
    "eval": EvalConfig,
    "checkpoint": CheckpointConfig,
    "logging": LoggingConfig,
    "activation_checkpointing": ActivationCheckpointConfig,
    "pipeline": PipelineConfig,
}


@dataclass
class TrainingConfig:
    model: ModelConfig
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=SyntheticData)
    tokenizer: str | None = None
    seq_length: int = 128
    batch: BatchConfig = field(default_factory=BatchConfig)
    train: TrainLengthConfig = field(default_factory=TrainLengthConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    activation_checkpointing: ActivationCheckpointConfig = field(default_factory=ActivationCheckpointConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    deepspeed_config: str | dict | None = None
    kernels: str = "auto"
    lora: LoraConfig | None = None
    seed: int = 1234
    output_dir: str = "runs/default"

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
                kwargs[name] = _section(section_cls, name, data.pop(name))
        if data.get("lora") is not None:
            kwargs["lora"] = LoraConfig.from_dict(data.pop("lora"))
        kwargs.update(data)
        config = cls(**kwargs)
        config.validate()
        return config

    @classmethod
    def from_file(cls, path: str, overrides: list[str] | None = None) -> TrainingConfig:
        data = read_json(path, "training config")
        for item in overrides or []:
            apply_override(data, item)
        return cls.from_dict(data)

    def validate(self) -> None:
        """Everything that does not depend on the world size; run once, when the config is read."""
        if self.kernels not in KERNEL_CHOICES:
            raise ConfigError(f"kernels {self.kernels!r} is not one of {', '.join(KERNEL_CHOICES)}")
        if not isinstance(self.seq_length, int) or self.seq_length < 1:
            raise ConfigError(f"seq_length must be a positive integer, got {self.seq_length!r}")
        self.parallel.validate(self.model)
        self.parallel.check_seq_length(self.seq_length)
        b = self.batch
        if b.micro_batch_size < 1 or b.global_batch_size < 1:
            raise ConfigError("batch.micro_batch_size and batch.global_batch_size must be >= 1")
        if self.train.steps < 1:
            raise ConfigError(f"train.steps must be >= 1, got {self.train.steps}")
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
        if self.eval.interval < 0 or self.eval.iters < 1:
            raise ConfigError("eval.interval must be >= 0 and eval.iters >= 1")

    def check_world_size(self, world_size: int) -> None:
        """What the launch adds to :meth:`validate`: TP x PP divides the world, and the batch divides over DP."""
        self.parallel.check_world_size(world_size)
        b, dp = self.batch, self.data_parallel_size(world_size)
        if b.global_batch_size % (b.micro_batch_size * dp):
            raise ConfigError(
                f"batch.global_batch_size {b.global_batch_size} is not divisible by micro_batch_size "
                f"{b.micro_batch_size} x data parallel {dp}"
            )

    def data_parallel_size(self, world_size: int) -> int:
        return self.parallel.data_parallel_size(world_size)

    def gradient_accumulation_steps(self, world_size: int) -> int:
        return self.batch.accumulation_steps(self.data_parallel_size(world_size))

    def num_eval_runs(self) -> int:
        return 0 if not self.eval.interval else math.ceil(self.train.steps / self.eval.interval) + 1

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["data"] = self.data.to_dict()
        out["lora"] = self.lora.to_dict() if self.lora else None
        return out


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


def _section(section_cls, name: str, value: Any):
    if not isinstance(value, dict):
        raise ConfigError(f"training config section {name!r} must be an object")
    known = {f.name for f in dataclasses.fields(section_cls)}
    unknown = set(value) - known
    if unknown:
        raise ConfigError(f"unknown keys in {name!r}: {', '.join(sorted(unknown))}")
    value = dict(value)
    if "betas" in value:
        value["betas"] = tuple(value["betas"])
    return section_cls(**value)


def apply_override(data: dict[str, Any], item: str) -> None:
    """``a.b.c=value``; value is JSON when it parses as JSON, else a string."""
    if "=" not in item:
        raise ConfigError(f"--set expects key=value, got {item!r}")
    key, raw = item.split("=", 1)
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    parts = key.split(".")
    node = data
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {key}: {part!r} is not a section")
        node = child
    node[parts[-1]] = value
