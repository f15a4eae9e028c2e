"""Training checkpoints in DeepSpeed's format (directory layout: :mod:`llama_megatron.checkpoint.meta`),
written so a crash never breaks ``latest``.

A save writes into ``.tmp-global_step{N}``, and only when every rank has finished does rank 0 rename it and
then replace ``latest`` (write to a temp file, ``os.replace``). A process killed mid-save leaves a ``.tmp-`` dir
that the next save removes; ``latest`` still names the previous complete checkpoint. ``llama_megatron.json``
holds the run position (step, consumed samples) and the layout (TP, PP, DP, ZeRO stage, model config): resume
reads it before building anything, so layout changes are caught early, and a DP or CP change is handled through
DeepSpeed's universal checkpoint (converted once, beside the original) when ZeRO partitioned the optimizer state.

Nothing in a checkpoint is unpickled beyond tensors and plain data (:mod:`llama_megatron.checkpoint.safe_load`):
:func:`verify_load` checks every file a load may open before anything is built, and DeepSpeed's engine reads its
files through our loader. ``checkpoint.load: "auto"`` resumes from ``checkpoint.save`` when it holds a ``latest``
(a job restarted with the same command) and starts fresh otherwise.

Each rank also saves its torch RNG state (``rng_state_rank{R}.pt``: CPU and CUDA generators), the state dropout
masks (LoRA's) are drawn from; a resume in the same layout (TP, PP, DP, CP) restores it, so the run continues
as if uninterrupted. Under another layout ranks draw different streams anyway, so it is not restored there.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import torch

from llama_megatron.checkpoint.atomic import write_text_atomic
from llama_megatron.checkpoint.meta import LATEST_FILE, META_FILE, TMP_PREFIX, CheckpointMeta, step_tag
from llama_megatron.checkpoint.safe_load import (
    load_state_file,
    load_through_safe_engine,
    verify_checkpoint_dir,
)
from llama_megatron.checkpoint.universal import universal_checkpoint_info
from llama_megatron.errors import CheckpointError
from llama_megatron.parallel.launch import barrier
from llama_megatron.training.config import AUTO_LOAD, CheckpointConfig


def resolve_load_dir(cfg: CheckpointConfig) -> str | None:
    """The directory to load: ``checkpoint.load``, or for ``"auto"`` ``checkpoint.save`` once it holds a
    ``latest`` (None: nothing saved yet, start fresh)."""
    if cfg.load != AUTO_LOAD:
        return cfg.load
    return cfg.save if os.path.isfile(os.path.join(cfg.save, LATEST_FILE)) else None


def check_resume_layout(meta: CheckpointMeta, tensor: int, pipeline: int, load_dir: str) -> None:
    if (meta.tensor, meta.pipeline) != (tensor, pipeline):
        raise CheckpointError(
            f"checkpoint {load_dir}/{meta.tag} was saved with tensor={meta.tensor} pipeline={meta.pipeline}, "
            f"this run uses tensor={tensor} pipeline={pipeline}: convert it first with "
            f"`llama-megatron reshard --input {load_dir} --output DIR --tp {tensor} --pp {pipeline}`"
        )


def needs_universal(meta: CheckpointMeta, partitions: int) -> bool:
    """ZeRO partitions optimizer state over DeepSpeed's data-parallel group (DP x CP); another DP x CP degree needs
    DeepSpeed's universal checkpoint."""
    return meta.zero_partitions != partitions and meta.zero_stage >= 1


def universal_tag(tag: str) -> str:
    return f"{tag}_universal"


def verify_load(load_dir: str, meta: CheckpointMeta, partitions: int | None) -> None:
    """Check every file this load may open, weights-only, before any process group or output exists: the tag,
    and the universal checkpoint beside it when a resume at another DP x CP degree (``partitions``; None for
    fine-tuning) will load it. DeepSpeed reads universal checkpoints, and ``ds_to_universal`` the tag, with its
    own ``torch.load(weights_only=False)``: this check is what stands before those."""
    verify_checkpoint_dir(os.path.join(load_dir, meta.tag))
    universal = os.path.join(load_dir, universal_tag(meta.tag))
    if partitions is not None and needs_universal(meta, partitions) and os.path.isdir(universal):
        verify_checkpoint_dir(universal)


def ensure_universal(load_dir: str, tag: str, rank: int) -> str:
    """Convert ``tag`` to a universal checkpoint once (rank 0; atomic), return the universal tag."""
    converted = universal_tag(tag)
    target = os.path.join(load_dir, converted)
    if rank == 0 and not os.path.isdir(target):
        tmp = os.path.join(load_dir, TMP_PREFIX + converted)
        shutil.rmtree(tmp, ignore_errors=True)
        cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
               os.path.join(load_dir, tag), "--output_folder", tmp, "--num_extract_workers", "1",
               "--num_merge_workers", "1"]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            tail = (result.stderr or result.stdout).strip().splitlines()[-1:]
            raise CheckpointError(f"converting {load_dir}/{tag} to a universal checkpoint failed: {tail}")
        shutil.copy(os.path.join(load_dir, tag, META_FILE), os.path.join(tmp, META_FILE))
        os.replace(tmp, target)
    barrier()
    return converted


RNG_FILE = "rng_state_rank{:05d}.pt"


def _save_rng_state(tag_dir: str, rank: int) -> None:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    torch.save(state, os.path.join(tag_dir, RNG_FILE.format(rank)))


def restore_rng_state(load_dir: str, tag: str, rank: int) -> bool:
    """This rank's RNG state as saved with ``tag`` (same layout only); False for checkpoints without one."""
    path = os.path.join(load_dir, tag, RNG_FILE.format(rank))
    if not os.path.isfile(path):
        return False
    state = load_state_file(path)
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    return True


def save_checkpoint(engine, save_dir: str, meta: CheckpointMeta, keep_last: int, rank: int) -> str:
    tag = step_tag(meta.step)
    tmp_tag = TMP_PREFIX + tag
    if rank == 0:
        os.makedirs(save_dir, exist_ok=True)
        shutil.rmtree(os.path.join(save_dir, tmp_tag), ignore_errors=True)
    barrier()
    from deepspeed.checkpoint.constants import UNIVERSAL_CHECKPOINT_INFO

    lora = engine.config.lora
    client_state = {UNIVERSAL_CHECKPOINT_INFO: universal_checkpoint_info(engine.config.model, lora)}
    # a LoRA run saves its adapters (and their optimizer state) only: the base is the checkpoint meta.lora names
    engine.engine.save_checkpoint(save_dir, tag=tmp_tag, client_state=client_state, save_latest=False,
                                  exclude_frozen_parameters=lora is not None)
    _save_rng_state(os.path.join(save_dir, tmp_tag), rank)
    barrier()
    if rank == 0:
        tmp_dir, final_dir = os.path.join(save_dir, tmp_tag), os.path.join(save_dir, tag)
        write_text_atomic(os.path.join(tmp_dir, META_FILE), meta.to_json())
        if os.path.isdir(final_dir):
            shutil.rmtree(final_dir)
        os.replace(tmp_dir, final_dir)
        write_text_atomic(os.path.join(save_dir, LATEST_FILE), tag)
        _prune(save_dir, keep_last)
    barrier()
    return tag


def _prune(save_dir: str, keep_last: int) -> None:
    if keep_last <= 0:
        return
    steps = sorted(
        (int(m.group(1)), name) for name in os.listdir(save_dir)
        if (m := re.fullmatch(r"global_step(\d+)", name))
    )
    for _, name in steps[:-keep_last]:
        shutil.rmtree(os.path.join(save_dir, name), ignore_errors=True)
        shutil.rmtree(os.path.join(save_dir, universal_tag(name)), ignore_errors=True)


def load_checkpoint(engine, load_dir: str, tag: str) -> None:
    """Resume: model, optimizer and LR state through DeepSpeed, its files read by our weights-only loader. A LoRA
    checkpoint holds the adapters only (the base is loaded already), so its module state is loaded non-strictly;
    preflight has checked that it holds exactly this run's adapters."""
    weight_decay = [group["weight_decay"] for group in engine.optimizer.param_groups]
    try:
        path, _ = load_through_safe_engine(engine.engine).load_checkpoint(
            load_dir, tag=tag, load_module_strict=engine.config.lora is None)
    except CheckpointError:
        raise
    except Exception as exc:  # DeepSpeed/torch raise many types for truncated or mismatched files
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"cannot load checkpoint {load_dir}/{tag}: {message}") from None
    if path is None:
        raise CheckpointError(f"cannot load checkpoint {load_dir}/{tag}: DeepSpeed found no model files")
    if engine.engine.load_universal_checkpoint():
        _repair_universal_optimizer(engine.optimizer, weight_decay)


def _repair_universal_optimizer(optimizer, weight_decay: list[float]) -> None:
    """Undo two slips of DeepSpeed 0.19.8's ZeRO-3 universal loader (``stage3.py``,
    ``load_hp_checkpoint_state_from_checkpoint_dir_stage3``): it gives every param group the hyperparameters of
    group 0 (weight decay on norms), and one Adam ``step`` tensor to every group, so the step count advances once
    per group per step. The ZeRO-1/2 and bf16 loaders restore each group's own (a no-op for them)."""
    for group, decay in zip(optimizer.param_groups, weight_decay):
        group["weight_decay"] = decay
    for state in optimizer.optimizer.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].clone()
