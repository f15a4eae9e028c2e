"""Whether and how a run resumes, decided once: :func:`plan_resume` reads the config and the checkpoint directory and
returns a :class:`ResumePlan` (what is loaded from where, weights only or the whole state, at which degrees, through
a universal checkpoint or not, a LoRA run's base), or refuses with one line (:class:`ConfigError`,
:class:`CheckpointError`) before any process group exists. Preflight makes the plan, the setup path and the loader
read it (training/run/setup.py), the loop asks :func:`finished_run` whether there is anything left to train.

The refusals, in the order they are checked: the tag (``latest``, ``checkpoint.tag``, or with ``checkpoint.load:
auto`` the newest complete one), the TP and PP degrees (a resume keeps them; ``reshard`` converts), the padded
vocabulary, the model config (a fine-tuning start may change the context keys), the expert degree and the layers'
placement where the optimizer state is per rank (ZeRO-0), a universal checkpoint a ZeRO-0 fp32 optimizer cannot
read, every file the load may open; for training, a save directory that holds another run's checkpoints.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field

from llama_megatron.checkpoint.directory import (
    LATEST_FILE,
    CheckpointMeta,
    read_latest,
    read_meta,
    saved_tags,
    universal_tag,
)
from llama_megatron.checkpoint.lora_checkpoint import BaseRecord, check_lora_start
from llama_megatron.checkpoint.manifest import verify_tag
from llama_megatron.checkpoint.safe_load import verify_checkpoint_dir
from llama_megatron.config import ModelConfig
from llama_megatron.errors import CheckpointError, ConfigError
from llama_megatron.training.config import AUTO_LOAD, CheckpointConfig, TrainingConfig
from llama_megatron.training.engine.deepspeed_config import precision, zero_stage


@dataclass(frozen=True)
class ResumePlan:
    """What a run loads, decided once (module docstring). ``checkpoint`` is the tag's metadata (None: a seeded
    start); ``weights_only`` a fine-tuning start (the weights read per layer and TP rank, any PP, DP and ZeRO);
    ``universal`` a resume whose ZeRO partitions or layer placement changed, loaded through DeepSpeed's universal
    checkpoint; ``skipped`` the tags passed over after a failed checksum (``checkpoint.load: auto``)."""

    load_dir: str | None = None  # checkpoint.load, "auto" resolved (None: nothing to load)
    checkpoint: CheckpointMeta | None = None
    lora_base: BaseRecord | None = None  # a LoRA run's base checkpoint
    weights_only: bool = False
    universal: bool = False
    placement_changes: bool = False  # the layers sit on other pipeline ranks than in the checkpoint's run
    start: str | None = None  # where the run's first step started from: its checkpoints' run record
    notes: tuple[str, ...] = ()  # for the log: checkpoints passed over
    skipped: frozenset[str] = field(default=frozenset())

    @property
    def resumes(self) -> bool:
        """The whole state is loaded: the run continues at the checkpoint's step."""
        return self.checkpoint is not None and not self.weights_only

    @property
    def adapters_checkpoint(self) -> bool:
        """``checkpoint.load`` holds LoRA adapters: the base weights come from the checkpoint it records."""
        return self.checkpoint is not None and self.checkpoint.lora is not None


def plan_resume(config: TrainingConfig, world_size: int, ds_config: dict, check_save: bool,
                skip: frozenset[str] = frozenset()) -> ResumePlan:
    """The run's :class:`ResumePlan`, every check made (module docstring). ``check_save``: the run writes
    ``checkpoint.save`` (training), which must not hold another run's checkpoints. ``skip``: tags that failed their
    checksums, passed over under ``checkpoint.load: auto``."""
    load_dir = resolve_load_dir(config.checkpoint)
    meta, notes = _check_checkpoint(config, load_dir, world_size, ds_config, skip)
    start = run_start(config, meta)
    if check_save:
        check_save_dir(config, load_dir, start)
    lora_base = _check_lora(config, meta, load_dir)
    weights_only = meta is not None and config.checkpoint.finetune
    partitions = config.data_parallel_size(world_size) * config.parallel.context  # DeepSpeed's DP group
    placement = config.pipeline.layer_placement(config.parallel.pipeline)
    universal = (meta is not None and not weights_only
                 and needs_universal(meta, partitions, placement, config.parallel.expert))
    return ResumePlan(load_dir, meta, lora_base, weights_only, universal,
                      meta is not None and placement_changes(meta, placement), start, tuple(notes), skip)


def replan_without(plan: ResumePlan, tag: str, config: TrainingConfig, world_size: int,
                   ds_config: dict) -> ResumePlan:
    """The plan once ``tag`` failed its checksums: the newest good tag instead (``checkpoint.load: auto`` only)."""
    return plan_resume(config, world_size, ds_config, check_save=False, skip=plan.skipped | {tag})


def resolve_load_dir(cfg: CheckpointConfig) -> str | None:
    """The directory to load: ``checkpoint.load``, or for ``"auto"`` ``checkpoint.save`` once it holds a
    checkpoint (None: nothing saved yet, start fresh). With ``checkpoint.overwrite`` ``"auto"`` starts fresh: the
    run starts again and replaces what ``save`` holds (every message that says how to start a run again says
    overwrite; resuming there would train nothing past a finished run)."""
    if cfg.load != AUTO_LOAD:
        return cfg.load
    if cfg.overwrite:
        return None
    has_any = os.path.isfile(os.path.join(cfg.save, LATEST_FILE)) or saved_tags(cfg.save)
    return cfg.save if has_any else None


def choose_tag(load_dir: str, tag: str | None, fallback: bool,
               skip: frozenset[str] = frozenset()) -> tuple[CheckpointMeta, list[str]]:
    """The tag to load and its metadata, its files present with the sizes its manifest lists: ``tag``, else the
    one ``latest`` names. With ``fallback`` (``checkpoint.load: auto``), when that one is missing, incomplete or
    damaged (or in ``skip``), the newest complete save that passes instead, with one note per tag passed over."""
    if not fallback:
        meta = read_meta(load_dir, tag)
        verify_tag(os.path.join(load_dir, meta.tag), checksum=False)
        return meta, []
    notes = []
    try:
        candidates = [read_latest(load_dir)]
    except CheckpointError as exc:
        candidates = []
        notes.append(f"passing over {exc}")
    candidates += [name for name in saved_tags(load_dir) if name not in candidates]
    for name in candidates:
        if name in skip:
            continue
        try:
            meta = read_meta(load_dir, name)
            verify_tag(os.path.join(load_dir, name), checksum=False)
        except CheckpointError as exc:
            notes.append(f"passing over {exc}")
            continue
        if notes:
            notes.append(f"resuming from {load_dir}/{name}, the newest complete checkpoint")
        return meta, notes
    raise CheckpointError(f"no complete checkpoint in {load_dir}" + (f" ({notes[0]})" if notes else ""))


def resumes_save_dir(cfg: CheckpointConfig, load_dir: str | None) -> bool:
    """Whether the run loads (and so continues) the run saved in ``checkpoint.save``."""
    return bool(cfg.save and load_dir is not None and os.path.isdir(load_dir) and os.path.isdir(cfg.save)
                and os.path.samefile(load_dir, cfg.save))


def finished_run(config: TrainingConfig) -> CheckpointMeta | None:
    """The checkpoint in ``checkpoint.save`` that holds this run at ``train.steps`` or later, where there is nothing
    to train (a finished job started again, a recipe run twice). This run: the one a resume would continue
    (``checkpoint.load: auto``), or one whose record (:meth:`TrainingConfig.run_record`) equals this config's: the
    same model, data, optimizer, seed and start. Never with ``checkpoint.overwrite`` (start again)."""
    cfg = config.checkpoint
    if not cfg.save or cfg.overwrite:
        return None
    try:
        if not cfg.finetune and resumes_save_dir(cfg, resolve_load_dir(cfg)):
            meta, _ = choose_tag(cfg.save, cfg.tag, fallback=cfg.load == AUTO_LOAD)
            return meta if meta.step >= config.train.steps else None
        tags = saved_tags(cfg.save)
        if not tags or cfg.load is not None and not cfg.finetune:  # a resume of another directory's checkpoint
            return None
        meta = read_meta(cfg.save, tags[0])
    except CheckpointError:
        return None
    start = cfg.load if cfg.finetune else None
    return meta if meta.step >= config.train.steps and meta.run == config.run_record(start) else None


def _record_differences(saved: dict, run: dict, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two run records (``config.optimizer.lr``, ``start``); the training
    JSON's keys under ``config.``."""
    keys = []
    for key in sorted(set(saved) | set(run)):
        a, b = saved.get(key), run.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            keys += _record_differences(a, b, f"{prefix}{key}.")
        elif a != b:
            keys.append(f"{prefix}{key}")
    return keys


def check_save_dir(config: TrainingConfig, load_dir: str | None, start: str | None) -> None:
    """A run that does not continue ``checkpoint.save`` may not write into one that holds checkpoints (its
    retention and ``latest`` would mix two runs) unless ``checkpoint.overwrite`` says to replace them. The refusal
    says what the saves there are: this very run (the same record, ``start`` being where this one starts), not
    finished yet, or another run and where it differs."""
    cfg = config.checkpoint
    if not cfg.save or cfg.overwrite or resumes_save_dir(cfg, load_dir):
        return
    existing = saved_tags(cfg.save)
    if not existing:
        return
    shown = ", ".join(existing[:3]) + (", ..." if len(existing) > 3 else "")
    try:
        newest = read_meta(cfg.save, existing[0])
    except CheckpointError:
        newest = None
    record = config.run_record(start)
    if newest is not None and newest.run == record:
        how = "checkpoint.load auto" + (" and checkpoint.finetune false" if cfg.finetune else "")
        raise ConfigError(f"checkpoint.save {cfg.save} holds this run's checkpoints ({shown}: the same config, seed "
                          f"and start) up to step {newest.step} of {config.train.steps}: continue it with {how}, or "
                          "start it again with checkpoint.overwrite true")
    differs = ""
    if newest is not None and newest.run is not None:
        keys = [key.removeprefix("config.").replace("start", "the checkpoint it started from")
                for key in _record_differences(newest.run, record)]
        differs = f" (it differs in {', '.join(keys[:4])}{', ...' if len(keys) > 4 else ''})"
    raise ConfigError(f"checkpoint.save {cfg.save} already holds checkpoints ({shown}) of another run{differs}: save "
                      "this one elsewhere, or replace them with checkpoint.overwrite true (that run continues with "
                      "its own config and checkpoint.load auto)")


def check_resume_layout(meta: CheckpointMeta, tensor: int, pipeline: int, load_dir: str) -> None:
    if (meta.tensor, meta.pipeline) != (tensor, pipeline):
        raise CheckpointError(
            f"checkpoint {load_dir}/{meta.tag} was saved with tensor={meta.tensor} pipeline={meta.pipeline}, "
            f"this run uses tensor={tensor} pipeline={pipeline}: convert it first with "
            f"`llama-megatron reshard --input {load_dir} --output DIR --tp {tensor} --pp {pipeline}`"
        )


def check_resume_experts(meta: CheckpointMeta, expert: int, load_dir: str) -> None:
    """A resume at another expert-parallel degree re-partitions the experts' optimizer state through a universal
    checkpoint (:func:`needs_universal`), which is made of ZeRO-1/2 partitions: a ZeRO-0 checkpoint (only EP 1 saves
    one) holds each rank's optimizer state whole, in its parameters' order, and resumes at its own EP only."""
    if meta.expert != expert and meta.zero_stage == 0:
        raise CheckpointError(
            f"checkpoint {load_dir}/{meta.tag} was saved with expert={meta.expert} under ZeRO-0, this run uses "
            f"expert={expert}: a resume at another expert degree needs a ZeRO-1/2 checkpoint; resume at "
            f"expert={meta.expert}, or start from its weights with checkpoint.finetune true"
        )


def placement_changes(meta: CheckpointMeta, layer_placement: dict | None) -> bool:
    """The run places the layers on other pipeline ranks than the checkpoint's run did (another schedule's
    placement, virtual stages or split; an older checkpoint placed them as DeepSpeed's 1F1B does)."""
    if meta.pipeline == 1 or layer_placement is None:
        return False
    saved = meta.layer_placement or {"shape": "loop", "virtual_stages": 1, "split": layer_placement["split"]}
    return saved != layer_placement


def needs_universal(meta: CheckpointMeta, partitions: int, layer_placement: dict | None = None,
                    expert: int | None = None) -> bool:
    """ZeRO partitions each pipeline rank's optimizer state over DeepSpeed's data-parallel group (DP x CP), and the
    experts' over their expert-data-parallel group (DP x CP / EP); another DP x CP or ``expert`` degree (None: the
    checkpoint's), or the layers on other pipeline ranks, needs DeepSpeed's universal checkpoint (its state per
    parameter, by name: a layer's names do not depend on where it sits, an expert's carry its global id)."""
    expert = meta.expert if expert is None else expert
    return meta.zero_stage >= 1 and (meta.zero_partitions != partitions or meta.expert != expert
                                     or placement_changes(meta, layer_placement))


def check_universal_reader(meta: CheckpointMeta, partitions: int, layer_placement: dict | None, expert: int,
                           zero: int, run_precision: str, load_dir: str) -> None:
    """A resume through a universal checkpoint (:func:`needs_universal`) hands each parameter's state to DeepSpeed's
    ZeRO or bf16 optimizer, which cut it for their partitions; a ZeRO-0 fp32 run's optimizer is torch's own and
    cannot read it (DeepSpeed fails at its first call into it)."""
    if zero == 0 and run_precision == "fp32" and needs_universal(meta, partitions, layer_placement, expert):
        raise CheckpointError(
            f"checkpoint {load_dir}/{meta.tag} (ZeRO-{meta.zero_stage}, {meta.zero_partitions} data-parallel x "
            f"context partitions, expert={meta.expert}) resumes in this layout through a universal checkpoint, "
            "which DeepSpeed loads into a ZeRO-1/2/3 or bf16 run only, and this run is ZeRO-0 fp32: resume under "
            "ZeRO-1 or 2 (e.g. deepspeed_config ds_configs/zero1_fp32.json), in the checkpoint's layout, or start "
            "from its weights with checkpoint.finetune true"
        )


def check_resume_placement(meta: CheckpointMeta, layer_placement: dict | None, load_dir: str) -> None:
    """Without ZeRO the optimizer state is each rank's own, in its parameters' order: it resumes only where every
    layer sits where it sat."""
    if meta.zero_stage == 0 and placement_changes(meta, layer_placement):
        saved = meta.layer_placement or "DeepSpeed's one block per rank"
        raise CheckpointError(
            f"checkpoint {load_dir}/{meta.tag} placed the layers on the pipeline ranks as {saved}, this run as "
            f"{layer_placement}, and its optimizer state (ZeRO-0) is per rank: resume with the schedule it was saved "
            "with, save under ZeRO-1 (resumed through a universal checkpoint), or start from its weights with "
            "checkpoint.finetune true"
        )


def verify_load(load_dir: str, meta: CheckpointMeta, partitions: int | None,
                layer_placement: dict | None = None, expert: int | None = None) -> None:
    """Check every file this load may open, weights-only, before any process group or output exists: the tag,
    and the universal checkpoint beside it when a resume at another DP x CP degree (``partitions``; None for
    fine-tuning) will load it. DeepSpeed reads universal checkpoints, and ``ds_to_universal`` the tag, with its
    own ``torch.load(weights_only=False)``: this check is what stands before those."""
    verify_checkpoint_dir(os.path.join(load_dir, meta.tag))
    universal = os.path.join(load_dir, universal_tag(meta.tag))
    if partitions is not None and needs_universal(meta, partitions, layer_placement, expert) and \
            os.path.isdir(universal):
        verify_checkpoint_dir(universal)


def run_start(config: TrainingConfig, meta: CheckpointMeta | None) -> str | None:
    """Where a run's first step started from (its record's ``start``): the checkpoint a fine-tuning run loads the
    weights of; for a resume, the start the resumed checkpoint records (a run continued is still the run that
    started there); None from a seeded init."""
    if meta is None:
        return None
    if config.checkpoint.finetune:
        return config.checkpoint.load
    return (meta.run or {}).get("start")


# What context extension changes: a fine-tuning start may set them anew (the weights do not depend on them).
CONTEXT_KEYS = ("max_position_embeddings", "rope_theta", "rope_scaling")


# What says which layers attend through a window: compared by the windows they give. transformers 5 writes a Qwen
# model's layer_types into its config.json, where a preset names max_window_layers instead.
WINDOW_KEYS = frozenset(("layer_types", "max_window_layers", "use_sliding_window", "sliding_window"))


def _model_differences(saved: dict, run: dict, finetune: bool) -> list[str]:
    """Keys of the model config that differ between a checkpoint and this run (a resume must change none)."""
    keys = sorted(set(saved) | set(run))
    differences = [k for k in keys if saved.get(k) != run.get(k) and not (finetune and k in CONTEXT_KEYS)]
    if WINDOW_KEYS.intersection(differences):
        with contextlib.suppress(ConfigError):
            if ModelConfig.from_dict(saved).layer_windows() == ModelConfig.from_dict(run).layer_windows():
                differences = [k for k in differences if k not in WINDOW_KEYS]
    return differences


def _check_checkpoint(config: TrainingConfig, load_dir: str | None, world_size: int, ds_config: dict,
                      skip: frozenset[str] = frozenset()) -> tuple[CheckpointMeta | None, list[str]]:
    """The checkpoint this run loads (metadata, layout and files checked) and notes for the log. With
    ``checkpoint.load: auto`` a damaged newest tag (or those in ``skip``) gives way to the newest good one."""
    if not load_dir:
        return None, []
    finetune = config.checkpoint.finetune
    meta, notes = choose_tag(load_dir, config.checkpoint.tag, fallback=config.checkpoint.load == AUTO_LOAD,
                                  skip=skip)
    # weights-only loading reads per (layer, TP rank): any PP of this run will do
    pipeline = meta.pipeline if finetune else config.parallel.pipeline
    check_resume_layout(meta, config.parallel.tensor, pipeline, load_dir)
    padded = config.local_shapes.padded_vocab_size
    if meta.padded_vocab_size != padded:
        raise ConfigError(
            f"checkpoint {load_dir}/{meta.tag} pads the vocab to {meta.padded_vocab_size}, this "
            f"run to {padded}: set parallel.make_vocab_size_divisible_by to match, or reshard the checkpoint"
        )
    differences = _model_differences(meta.model, config.model.to_dict(), finetune)
    if differences:
        hint = "" if finetune else f"; a fine-tuning start may change {', '.join(CONTEXT_KEYS)}"
        raise ConfigError(f"checkpoint {load_dir}/{meta.tag} holds a different model config than this run's model "
                          f"section ({', '.join(differences)}){hint}")
    partitions = config.data_parallel_size(world_size) * config.parallel.context  # DeepSpeed's DP group
    placement = config.pipeline.layer_placement(config.parallel.pipeline)
    if not finetune:
        check_resume_experts(meta, config.parallel.expert, load_dir)
        check_resume_placement(meta, placement, load_dir)
        check_universal_reader(meta, partitions, placement, config.parallel.expert, zero_stage(ds_config),
                                    precision(ds_config), load_dir)
    verify_load(load_dir, meta, None if finetune else partitions, placement, config.parallel.expert)
    return meta, notes


def _check_lora(config: TrainingConfig, meta: CheckpointMeta | None, load_dir: str | None) -> BaseRecord | None:
    """A LoRA run's base checkpoint (refusals: see :func:`check_lora_start`); the base of an adapter checkpoint is
    read per TP rank like any weights-only start."""
    record, base = check_lora_start(config.lora, meta, load_dir, config.checkpoint.finetune,
                                    auto=config.checkpoint.load == AUTO_LOAD)
    if base is not None:
        check_resume_layout(base, config.parallel.tensor, base.pipeline, record.path)
        differences = _model_differences(base.model, config.model.to_dict(), finetune=False)
        if differences:
            raise ConfigError(f"base checkpoint {record.path}/{base.tag} holds a different model config than this "
                              f"run's model section ({', '.join(differences)})")
        verify_load(record.path, base, None)
    return record
