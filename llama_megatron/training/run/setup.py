"""The one setup path of every command that runs the model.

config -> :func:`preflight` (every check that needs no process group) -> :func:`start` (process groups and
seeds: :func:`start_process_groups`; run logger, ``run.json``) -> :func:`load_model` (seeded init, or weights read
from a checkpoint) -> :func:`open_session` (DeepSpeed engine, optimizer and the checkpoint's full state).
``train`` and ``evaluate`` use the whole path; ``generate`` (training/run/generate.py) needs only the model: process
groups, then :func:`load_model`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
from dataclasses import dataclass, field, replace

import numpy as np
import torch
from torch import nn

from llama_megatron.checkpoint.directory import CheckpointMeta
from llama_megatron.checkpoint.lora_checkpoint import BaseRecord, checkpoint_lora_section
from llama_megatron.checkpoint.manifest import verify_tag
from llama_megatron.checkpoint.megatron_reader import load_model_weights
from llama_megatron.checkpoint.universal import conversion as universal
from llama_megatron.errors import CheckpointError, ConfigError
from llama_megatron.model.build import build_model
from llama_megatron.model.kernels import Kernels, resolve_kernels
from llama_megatron.parallel.context import ParallelContext
from llama_megatron.parallel.float8 import Float8Config, float8_gemm_supported
from llama_megatron.parallel.placement import placement
from llama_megatron.parallel.process_groups import init_distributed
from llama_megatron.parallel.zero3 import is_partitioned
from llama_megatron.training import checkpointing as ckpt
from llama_megatron.training.config import AUTO_LOAD, TrainingConfig
from llama_megatron.training.diagnostics.stage_census import moe_layers_per_pipeline_rank
from llama_megatron.training.engine.deepspeed_config import build_deepspeed_config, precision, zero_stage
from llama_megatron.training.engine.training_engine import TrainingEngine
from llama_megatron.training.objectives import objective_of
from llama_megatron.training.pipeline.schedules import analytic_bubble
from llama_megatron.training.resume import ResumePlan, plan_resume, replan_without
from llama_megatron.training.run.metrics import RunLogger
from llama_megatron.training.save_dir import SaveDirLock, take_save_dir

RUN_INFO_FILE = "run.json"


@dataclass
class Preflight:
    """A validated run, before any process group exists: its config, DeepSpeed config, kernels and what it loads
    (``resume``: training/resume.py decides it, once)."""

    config: TrainingConfig
    world_size: int
    ds_config: dict
    resume: ResumePlan
    eod_id: int | None
    kernels: Kernels
    notes: list[str] = field(default_factory=list)  # for the log: checkpoints passed over, unverified ones

    @property
    def checkpoint(self) -> CheckpointMeta | None:
        return self.resume.checkpoint

    @property
    def load_dir(self) -> str | None:
        return self.resume.load_dir

    @property
    def lora_base(self) -> BaseRecord | None:
        return self.resume.lora_base

    @property
    def adapters_checkpoint(self) -> bool:
        return self.resume.adapters_checkpoint

    @property
    def weights_only(self) -> bool:
        """Fine-tuning start: read the weights per (layer, TP rank) before DeepSpeed wraps the model, so any PP,
        DP and ZeRO stage of this run can start from the checkpoint."""
        return self.resume.weights_only

    @property
    def run_start(self) -> str | None:
        """Where this run's first step started from, for its checkpoints' run record."""
        return self.resume.start

    def checkpoint_lora(self) -> dict | None:
        """``llama_megatron.json``'s ``lora`` for this run's saves (None: not a LoRA run)."""
        if self.config.lora is None:
            return None
        return checkpoint_lora_section(self.config.lora, self.lora_base)


@dataclass
class Session:
    """A started run: process groups, logger, DeepSpeed engine, and where in the data it stands."""

    pre: Preflight
    pctx: ParallelContext
    log: RunLogger
    engine: TrainingEngine
    step: int
    consumed_samples: int
    owner: SaveDirLock | None = None  # held while the run may write checkpoint.save

    def close(self) -> None:
        self.log.close()
        if self.owner is not None:
            self.owner.release()

    @property
    def config(self) -> TrainingConfig:
        return self.pre.config


def _check_tokenizer(config: TrainingConfig) -> int | None:
    """Tokenizer ids must fit the model's embedding table; returns its EOD id for per-document attention."""
    if not config.tokenizer:
        return None
    from llama_megatron.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(config.tokenizer)
    tokenizer.check_against_model_vocab(config.model.vocab_size)
    return tokenizer.eos_id


MODES = ("train", "evaluate", "generate")


def preflight(config: TrainingConfig, ds_source=None, world_size: int | None = None, mode: str = "train") -> Preflight:
    """Every check that needs no process group, so a bad setup fails in seconds with one line. ``mode`` says what
    the run does: training also checks that it may write into ``checkpoint.save``; training with evaluation steps
    and evaluation need a validation split."""
    where = placement()
    world_size = where.world_size if world_size is None else world_size
    config.check_world_size(world_size)
    config.data.validate()
    eod_id = _check_tokenizer(config)
    config.data.prepare(config.tokenizer)  # SFT JSONL: tokenised here once, so bad records stop before launch
    # what building the datasets would find late: ids beyond the vocabulary, no validation split to evaluate on
    config.data.check(config.model.vocab_size,
                      need_validation=mode == "evaluate" or (mode == "train" and config.eval.interval > 0))
    objective_of(config).check_prepared(config)
    if config.eval.tasks and config.eval.interval and mode == "train":
        _check_eval_tasks(config)
    accelerator = "cuda" if torch.cuda.is_available() else "cpu"
    ds_config = build_deepspeed_config(config, ds_source, world_size, accelerator)
    check_experts_on_every_stage(config, zero_stage(ds_config))
    if config.fp8 is not None:
        check_fp8_precision(config.fp8, precision(ds_config), accelerator)
    kernels = resolve_kernels(config.kernels, accelerator)
    resume = plan_resume(config, world_size, ds_config, check_save=mode == "train")
    notes = list(resume.notes)
    if where.world_size == world_size and where.group_spans_nodes(config.parallel.tensor):
        notes.append(f"warning: tensor parallel groups of {config.parallel.tensor} span nodes ({where.local_world_size} "
                     f"processes per node): their all-reduces, the heaviest traffic, cross the network; use a "
                     f"tensor degree that divides the processes per node")
    return Preflight(config, world_size, ds_config, resume, eod_id, kernels, notes)


def _check_eval_tasks(config: TrainingConfig) -> None:
    """``eval.tasks``: lm-eval installed, an HF tokenizer to tokenise the requests with, every task known and its
    data on this machine (training/run/lm_tasks.py), before any process starts."""
    try:
        from llama_megatron.training.run.lm_tasks import check_tasks
    except ImportError as exc:
        raise ConfigError(f"eval.tasks needs lm-evaluation-harness ({exc.name} is missing): pip install "
                          "'llama_megatron[eval]'") from None
    if not config.tokenizer or not os.path.isdir(config.tokenizer):
        raise ConfigError("eval.tasks tokenises lm-eval's requests with the run's tokenizer: set tokenizer to a "
                          "Hugging Face tokenizer directory")
    check_tasks(list(config.eval.tasks))


def check_experts_on_every_stage(config: TrainingConfig, zero: int) -> None:
    """Expert parallelism under ZeRO-1/2 with a pipeline: DeepSpeed's ZeRO splits the experts into parameter groups of
    their own and all-reduces each group's gradient norm over the model-parallel group, which spans the stages; a
    pipeline rank without MoE layers (a Llama 4 with MoE on alternate layers, one layer per virtual stage) has no such
    group and never joins (a hang)."""
    if config.parallel.expert == 1 or config.parallel.pipeline == 1 or zero == 0:
        return
    bare = [rank for rank, count in enumerate(moe_layers_per_pipeline_rank(config)) if count == 0]
    if bare:
        raise ConfigError(f"expert parallelism under ZeRO-{zero} needs an MoE layer on every pipeline rank, and "
                          f"pipeline rank{'s' * (len(bare) > 1)} {', '.join(map(str, bare))} hold{'s' * (len(bare) == 1)}"
                          " dense layers only (DeepSpeed's ZeRO reduces the experts' gradient norm over every stage): "
                          "choose fewer virtual stages or pipeline.stage_layers that give each rank one, or ZeRO-0")


def check_fp8_precision(fp8: Float8Config, dtype: str, accelerator: str) -> None:
    """FP8 trains on top of bf16 (the master weights and optimizer in fp32, as DeepSpeed's bf16 keeps them), on a
    device with float8 GEMMs unless it emulates them."""
    if dtype != "bf16":
        raise ConfigError(f"fp8 trains on top of bf16, and this run's precision is {dtype}: use a bf16 deepspeed_config "
                          "(ds_configs/zero1_bf16.json) or drop fp8")
    if not fp8.emulate and not float8_gemm_supported(accelerator):
        raise ConfigError(f"fp8: this GPU ({torch.cuda.get_device_name()}, compute capability "
                          f"{'.'.join(map(str, torch.cuda.get_device_capability()))}) has no float8 GEMMs (8.9 or "
                          "newer: Ada, Hopper, Blackwell); set fp8.emulate true to train with emulated float8 GEMMs")


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def start_process_groups(pre: Preflight) -> ParallelContext:
    """torch.distributed, the TP/PP/DP groups, and the seeds."""
    config = pre.config
    init_distributed()
    par = config.parallel
    pctx = ParallelContext.build(par)
    _seed_everything(config.seed)
    return pctx


def start(pre: Preflight) -> tuple[ParallelContext, RunLogger]:
    """Process groups and seeds, the rank-0 logger, and ``OUTPUT_DIR/run.json`` (the run's layout, for plots)."""
    config = pre.config
    pctx = start_process_groups(pre)
    log = RunLogger(pctx.rank == 0, config.output_dir, config.logging.tensorboard_dir,
                    config.logging.wandb_project, config.to_dict())
    if pctx.rank == 0:
        info = {"world_size": pctx.world_size, "tensor": pctx.tp_size, "pipeline": pctx.pp_size,
                "context": pctx.cp_size, "data_parallel": pctx.dp_size, "sequence_parallel": pctx.sequence_parallel,
                "pipeline_schedule": config.pipeline.schedule if pctx.pp_size > 1 else None,
                "pipeline_virtual_stages": config.pipeline.virtual_stages if pctx.pp_size > 1 else None,
                # the schedule's idle share at equal pass costs: MFU counts it as lost time
                "pipeline_bubble": analytic_bubble(config.pipeline.schedule, pctx.pp_size,
                                                   config.gradient_accumulation_steps(pctx.world_size),
                                                   config.pipeline.virtual_stages),
                "zero_stage": zero_stage(pre.ds_config), "precision": precision(pre.ds_config),
                "micro_batch_size": config.batch.micro_batch_size,
                "global_batch_size": config.batch.global_batch_size, "seq_length": config.seq_length,
                "rows_per_sample": config.rows_per_sample,
                "kernels": pre.kernels.describe(moe=config.model.family.moe is not None),
                "model": config.model.to_dict(),
                "fp8": dataclasses.asdict(config.fp8) if config.fp8 else None}
        with open(os.path.join(config.output_dir, RUN_INFO_FILE), "w", encoding="utf-8") as fh:
            json.dump(info, fh, indent=2)
    described = pre.kernels.describe(moe=config.model.family.moe is not None)
    log.info("kernels: " + " | ".join(f"{k} {v}" for k, v in described.items()))
    if config.fp8 is not None:
        log.info(f"fp8: {config.fp8.recipe} scaling (torchao) on {', '.join(config.fp8.modules)}"
                 + (f" matching {config.fp8.filter}" if config.fp8.filter else "")
                 + (" (emulated GEMMs)" if config.fp8.emulate else ""))
    for note in pre.notes:
        log.info(note)
    return pctx, log


def verify_checkpoint_files(pre: Preflight, pctx: ParallelContext, log: RunLogger | None) -> Preflight:
    """The checksums of the tag to load against its manifest, each rank hashing its share of the files
    (``checkpoint.verify: checksum``; preflight checked every size already). A damaged tag is an error, or under
    ``checkpoint.load: auto`` gives way to the newest good one (checked again from the start)."""
    config = pre.config
    while pre.checkpoint is not None and config.checkpoint.verify == "checksum":
        tag_dir = os.path.join(pre.load_dir, pre.checkpoint.tag)
        error, verified = None, False
        try:
            verified = verify_tag(tag_dir, checksum=True, share=(pctx.rank, pctx.world_size))
        except CheckpointError as exc:
            error = str(exc)
        errors = [e for e in ckpt.all_gather_objects(error) if e]
        if not errors:
            if not verified and log is not None:
                log.info(f"checkpoint {tag_dir} has no manifest (written by an older version or another tool): "
                         "its files were not verified")
            break
        if config.checkpoint.load != AUTO_LOAD:
            raise CheckpointError(errors[0])
        resume = replan_without(pre.resume, pre.checkpoint.tag, config, pre.world_size, pre.ds_config)
        if log is not None:
            for note in [f"passing over {errors[0]}", *resume.notes]:
                log.info(note)
        pre = replace(pre, resume=resume)
    return pre


def load_model(pre: Preflight, pctx: ParallelContext) -> nn.Module:
    """This rank's model: seeded initial weights, or the checkpoint's weights when fine-tuning starts from one. A
    LoRA run's base weights come from its base checkpoint (``checkpoint.load``, or the one an adapter checkpoint
    records) before DeepSpeed wraps the model, as any weights-only start."""
    config = pre.config
    with partitioned_construction(pre.ds_config, pctx, config.distributed.zero3_init):
        model = build_model(config.model, config.parallel, pctx, seed=config.seed,
                            activation_checkpoint_interval=config.activation_checkpointing.interval,
                            partition_method=config.pipeline.partition_method, kernels=pre.kernels, lora=config.lora,
                            placement=config.pipeline.placement(pctx.pp_size),
                            stage_layers=config.pipeline.stage_layers, fp8=config.fp8, capacity=config.moe)
    if pre.adapters_checkpoint:
        load_model_weights(model, pre.lora_base.path, pre.lora_base.tag, pctx.tp_rank)
    if pre.weights_only:
        load_model_weights(model, pre.load_dir, pre.checkpoint.tag, pctx.tp_rank)
    return model


def partitioned_construction(ds_config: dict, pctx: ParallelContext, enabled: bool):
    """Under ZeRO-3 (with ``distributed.zero3_init``), DeepSpeed's ``zero.Init``: each parameter is partitioned over
    DP x CP (DeepSpeed's data-parallel group) as its module is made, and initialisation and checkpoint loading
    write each rank's slice only (parallel/zero3.py); a no-op context otherwise. The engine then finds the
    parameters partitioned already, as it leaves them after partitioning a whole model itself."""
    if not (enabled and zero_stage(ds_config) == 3):
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.Init(data_parallel_group=pctx.dp_cp_group, config_dict_or_path=ds_config, mpu=pctx)


def open_session(config: TrainingConfig, ds_source=None, mode: str = "train") -> Session:
    """The whole path: preflight, process groups, the save dir taken (training), the checkpoint's files verified,
    model and weights, DeepSpeed engine, checkpoint state."""
    pre = preflight(config, ds_source, mode=mode)
    pctx, log = start(pre)
    owner = take_save_dir(config.checkpoint, pre.load_dir, pctx, log) if mode == "train" else None
    pre = verify_checkpoint_files(pre, pctx, log)
    meta, resume = pre.checkpoint, pre.resume
    load_tag = meta.tag if meta else None
    if resume.universal:
        if resume.placement_changes:
            placement = config.pipeline.layer_placement(config.parallel.pipeline)
            log.info(f"layers on the pipeline ranks {meta.layer_placement or 'as DeepSpeed places them'} -> "
                     f"{placement}: loading through a universal checkpoint")
        else:
            log.info(f"ZeRO partitions (data parallel x context, expert parallel) {meta.data_parallel} x "
                     f"{meta.context}, {meta.expert} -> {pctx.dp_size} x {pctx.cp_size}, {pctx.ep_size}: loading "
                     "through a universal checkpoint")
        load_tag = universal.ensure_universal(pre.load_dir, meta.tag, pctx.rank, log.info,
                                              config.distributed.timeout_minutes, config.checkpoint.universal_workers)
        pre.ds_config.setdefault("checkpoint", {})["load_universal"] = True
    model = load_model(pre, pctx)
    partitioned = sum(is_partitioned(p) for p in model.parameters())
    if partitioned:
        log.info(f"ZeRO-3: the model was built partitioned (zero.Init): {partitioned} of "
                 f"{len(list(model.parameters()))} parameters, each rank holding 1/{pctx.dp_cp_size} of each")
    engine = TrainingEngine(config, pre.ds_config, pctx, model)
    step, consumed = 0, 0
    if meta and pre.weights_only:
        log.info(f"loaded the weights of checkpoint {pre.load_dir}/{meta.tag} (step {meta.step}) for fine-tuning")
    elif meta:
        ckpt.load_checkpoint(engine, pre.load_dir, load_tag)
        step, consumed = meta.step, meta.consumed_samples
        # TP and PP are the checkpoint's already (preflight refuses a resume under others)
        same_layout = (meta.data_parallel, meta.context) == (pctx.dp_size, pctx.cp_size)
        rng = "restored" if same_layout and ckpt.restore_rng_state(pre.load_dir, meta.tag, pctx.rank) else "fresh"
        log.info(f"resumed from checkpoint {pre.load_dir}/{meta.tag} (step {meta.step}; RNG state {rng})")
    elif config.checkpoint.load == AUTO_LOAD:
        log.info(f"no checkpoint in {config.checkpoint.save} yet: starting fresh (checkpoint.load auto)")
    if config.lora:
        trainable = sum(getattr(p, "ds_numel", p.numel()) for p in engine.model.parameters() if p.requires_grad)
        log.info(f"LoRA {config.lora.describe()}: {trainable:,} trainable parameters on rank 0 (base frozen: {pre.lora_base.path}/"
                 f"{pre.lora_base.tag})")
    return Session(pre, pctx, log, engine, step, consumed, owner)
