"""Training checkpoints in DeepSpeed's format (directory layout: :mod:`llama_megatron.checkpoint.meta`),
written so a crash never breaks ``latest``.

A save writes into ``.tmp-global_step{N}``, and only when every rank has finished does rank 0 rename it and
then replace ``latest`` (write to a temp file, ``os.replace``). A process killed mid-save leaves a ``.tmp-`` dir
that the next save removes; ``latest`` still names the previous complete checkpoint. ``llama_megatron.json``
holds the run position (step, consumed samples) and the layout (TP, PP, DP, ZeRO stage, model config): resume
reads it before building anything, so layout changes are caught early, and a DP change is handled through
DeepSpeed's universal checkpoint (converted once, beside the original).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

from llama_megatron.checkpoint.atomic import write_text_atomic
from llama_megatron.checkpoint.meta import LATEST_FILE, META_FILE, TMP_PREFIX, CheckpointMeta, step_tag
from llama_megatron.checkpoint.universal import universal_checkpoint_info
from llama_megatron.errors import CheckpointError
from llama_megatron.parallel.launch import barrier


def check_resume_layout(meta: CheckpointMeta, tensor: int, pipeline: int, load_dir: str) -> None:
    if (meta.tensor, meta.pipeline) != (tensor, pipeline):
        raise CheckpointError(
            f"checkpoint {load_dir}/{meta.tag} was saved with tensor={meta.tensor} pipeline={meta.pipeline}, "
            f"this run uses tensor={tensor} pipeline={pipeline}: convert it first with "
            f"`llama-megatron reshard --input {load_dir} --output DIR --tp {tensor} --pp {pipeline}`"
        )


def needs_universal(meta: CheckpointMeta, data_parallel: int) -> bool:
    """ZeRO partitions optimizer state over DP; another DP degree needs DeepSpeed's universal checkpoint."""
    return meta.data_parallel != data_parallel and meta.zero_stage >= 1


def ensure_universal(load_dir: str, tag: str, rank: int) -> str:
    """Convert ``tag`` to a universal checkpoint once (rank 0; atomic), return the universal tag."""
    universal_tag = f"{tag}_universal"
    target = os.path.join(load_dir, universal_tag)
    if rank == 0 and not os.path.isdir(target):
        tmp = os.path.join(load_dir, TMP_PREFIX + universal_tag)
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
    return universal_tag


def save_checkpoint(engine, save_dir: str, meta: CheckpointMeta, keep_last: int, rank: int) -> str:
    tag = step_tag(meta.step)
    tmp_tag = TMP_PREFIX + tag
    if rank == 0:
        os.makedirs(save_dir, exist_ok=True)
        shutil.rmtree(os.path.join(save_dir, tmp_tag), ignore_errors=True)
    barrier()
    from deepspeed.checkpoint.constants import UNIVERSAL_CHECKPOINT_INFO

    client_state = {UNIVERSAL_CHECKPOINT_INFO: universal_checkpoint_info(engine.config.model)}
    engine.engine.save_checkpoint(save_dir, tag=tmp_tag, client_state=client_state, save_latest=False)
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
        shutil.rmtree(os.path.join(save_dir, name + "_universal"), ignore_errors=True)


def load_checkpoint(engine, load_dir: str, tag: str, finetune: bool) -> None:
    try:
        path, _ = engine.engine.load_checkpoint(
            load_dir, tag=tag, load_optimizer_states=not finetune, load_lr_scheduler_states=not finetune,
            load_module_only=finetune,
        )
    except CheckpointError:
        raise
    except Exception as exc:  # DeepSpeed/torch raise many types for truncated or mismatched files
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"cannot load checkpoint {load_dir}/{tag}: {message}") from None
    if path is None:
        raise CheckpointError(f"cannot load checkpoint {load_dir}/{tag}: DeepSpeed found no model files")
