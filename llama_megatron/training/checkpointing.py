"""Training checkpoints in DeepSpeed's format (directory layout: :mod:`llama_megatron.checkpoint.directory`),
written so a crash never breaks ``latest``.

A save writes into ``.tmp-global_step{N}``, and only when every rank has finished does rank 0 rename it and
then replace ``latest`` (write to a temp file, ``os.replace``). A process killed mid-save leaves a ``.tmp-`` dir
that the next save removes; ``latest`` still names the previous complete checkpoint. ``llama_megatron.json``
holds the run position (step, consumed samples) and the layout (TP, PP, DP, ZeRO stage, model config): resume
reads it before building anything, so layout changes are caught early, and a DP or CP change is handled through
DeepSpeed's universal checkpoint (converted once, beside the original) when ZeRO partitioned the optimizer state.

Nothing in a checkpoint is unpickled beyond tensors and plain data (:mod:`llama_megatron.checkpoint.safe_load`):
:func:`~llama_megatron.training.resume.verify_load` checks every file a load may open before anything is built, and DeepSpeed's engine reads its
files through our loader. ``checkpoint.load: "auto"`` resumes from ``checkpoint.save`` when it holds a ``latest``
(a job restarted with the same command) and starts fresh otherwise.

Each rank also saves its torch RNG state (``rng_state_rank{R}.pt``: CPU and CUDA generators), the state dropout
masks (LoRA's) are drawn from; a resume in the same layout (TP, PP, DP, CP) restores it, so the run continues
as if uninterrupted. Under another layout ranks draw different streams anyway, so it is not restored there.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from llama_megatron.checkpoint.atomic import write_text_atomic
from llama_megatron.checkpoint.direct_io import save_direct
from llama_megatron.checkpoint.directory import (
    LATEST_FILE,
    META_FILE,
    TMP_PREFIX,
    CheckpointMeta,
    next_save_index,
    saved_tags,
    step_tag,
    universal_tag,
)
from llama_megatron.checkpoint.manifest import (
    digest_files,
    fsync_dir,
    fsync_tree,
    tag_files,
    write_manifest,
)
from llama_megatron.checkpoint.safe_load import (
    load_state_file,
    load_through_safe_engine,
)
from llama_megatron.checkpoint.universal.patterns import universal_checkpoint_info
from llama_megatron.errors import CheckpointError, SaveFailed
from llama_megatron.parallel.process_groups import barrier
from llama_megatron.training.background_save import BackgroundSaves, DirectEngine, write_failure_line

RNG_FILE = "rng_state_rank{:05d}.pt"


def _rng_state() -> dict:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def read_rank_state(load_dir: str, tag: str, rank: int, key: str):
    """What a run saved under ``key`` in this rank's state file of ``tag`` (``save_checkpoint``'s ``rank_state``:
    online RL's generation in progress); None where it saved nothing there."""
    path = os.path.join(load_dir, tag, RNG_FILE.format(rank))
    return load_state_file(path).get(key) if os.path.isfile(path) else None


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


def save_checkpoint(engine, save_dir: str, meta: CheckpointMeta, keep_last: int, pctx,
                    background: BackgroundSaves | None = None,
                    progress: Callable[[], None] | None = None, rank_state: dict | None = None) -> str | PendingSave:
    """Write ``meta``'s tag: DeepSpeed's files and each rank's RNG state into ``.tmp-<tag>``, every file hashed
    (SHA-256) as its rank writes it around the page cache, and fsynced; the manifest and metadata, then the rename,
    ``latest`` and retention (rank 0), each directory fsynced. A failure on any rank (a full disk, an I/O error) is seen by all:
    the temporary directory is removed and :class:`SaveFailed` is raised with one line; ``latest`` and the tags
    already there are untouched. With ``background`` (``checkpoint.async_save``) the files are copied to host
    memory and written by a thread: the :class:`PendingSave` returned finishes the same way once every rank's
    writer is done. ``progress`` is called as files are hashed (the watchdog's beat). ``rank_state``: more of this
    rank's state (tensors, numbers, strings), saved beside its RNG state (:func:`read_rank_state`)."""
    rank = pctx.rank
    tag = step_tag(meta.step)
    tmp_dir, final_dir = os.path.join(save_dir, TMP_PREFIX + tag), os.path.join(save_dir, tag)
    where = f"{save_dir}/{tag}"
    error = _attempt(lambda: (os.makedirs(save_dir, exist_ok=True), shutil.rmtree(tmp_dir, ignore_errors=True))
                     if rank == 0 else None)
    _agree(error, where, tmp_dir, pctx)
    from deepspeed.checkpoint.constants import UNIVERSAL_CHECKPOINT_INFO

    lora = engine.config.lora
    client_state = {UNIVERSAL_CHECKPOINT_INFO: universal_checkpoint_info(engine.config.model, lora)}

    def write_shards() -> None:
        # a LoRA run saves its adapters (and their optimizer state) only: the base is the checkpoint meta.lora names
        engine.engine.save_checkpoint(save_dir, tag=TMP_PREFIX + tag, client_state=client_state,
                                      save_latest=False, exclude_frozen_parameters=lora is not None)

    pending = PendingSave(tag, save_dir, tmp_dir, final_dir, meta, keep_last, pctx, background, progress)
    rng_file = RNG_FILE.format(rank)
    if background is not None:
        background.writer.reset()
        with background.capturing(engine.engine):
            error = _attempt(write_shards)
        if error:
            barrier()  # the ranks that succeeded wait in DeepSpeed's closing barrier
        state = {**_rng_state(), **(rank_state or {})}
        background.writer.submit(lambda: save_direct(state, os.path.join(tmp_dir, rng_file)), tmp_dir, rng_file)
        _agree(error, where, tmp_dir, pctx)
        return pending
    # each file written around the page cache and hashed as it is written, by the rank that writes it
    direct = DirectEngine(engine.engine.checkpoint_engine, progress)
    with direct.installed(engine.engine):
        error = _attempt(write_shards)
    if error:
        barrier()  # the ranks that succeeded wait in DeepSpeed's closing barrier
    error = error or _attempt(lambda: direct.digests.update(
        {rng_file: save_direct({**_rng_state(), **(rank_state or {})}, os.path.join(tmp_dir, rng_file))}))
    _agree(error, where, tmp_dir, pctx)
    # rank 0 checks its listing against what the ranks wrote and hashes what no rank did (finish)
    pending.finish(all_gather_objects(direct.digests))
    return tag


class PendingSave:
    """A save whose files may still be being written (``checkpoint.async_save``): :meth:`complete` finishes it
    (manifest, rename, ``latest``, retention) once every rank's writer is done, or raises its failure."""

    def __init__(self, tag: str, save_dir: str, tmp_dir: str, final_dir: str, meta: CheckpointMeta,
                 keep_last: int, pctx, background: BackgroundSaves | None,
                 progress: Callable[[], None] | None = None) -> None:
        self.tag, self.save_dir, self.tmp_dir, self.final_dir = tag, save_dir, tmp_dir, final_dir
        self.meta, self.keep_last, self.pctx, self.background = meta, keep_last, pctx, background
        self.host_copy_bytes = 0  # once complete: the largest rank's host copy (what ``estimate`` reports)
        self.progress = progress

    @property
    def where(self) -> str:
        return f"{self.save_dir}/{self.tag}"

    def complete(self, wait: bool) -> bool:
        """True once finished: every rank's writer done (waited for with ``wait``) and the tag in place; False
        while some rank still writes. Every rank must call it at the same point (one all-gather)."""
        writer = self.background.writer
        if wait:
            writer.wait()
        done = writer.done()  # read before the error: once done, no later write can fail
        statuses = all_gather_objects((done, writer.error))
        _agree_gathered([error for _, error in statuses], self.where, self.tmp_dir, self.pctx)
        if not all(done for done, _ in statuses):
            return False
        shares = all_gather_objects((dict(writer.digests), self.background.snapshots.nbytes))
        self.host_copy_bytes = max(nbytes for _, nbytes in shares)
        self.finish([digests for digests, _ in shares])
        return True

    def finish(self, shares: list[dict]) -> None:
        """Rank 0: the files no rank hashed (DeepSpeed's own small copies), the metadata and manifest, fsync, the
        rename, ``latest`` and retention; a failure is every rank's."""

        def finish() -> None:
            entries = {name: entry for share in shares for name, entry in share.items()}
            _check_listing(self.tmp_dir, entries, exact=False)
            entries.update(digest_files(self.tmp_dir, [n for n in tag_files(self.tmp_dir) if n not in entries],
                                        progress=self.progress))
            self.meta.saved_at = time.time()
            self.meta.save_index = next_save_index(self.save_dir)
            write_text_atomic(os.path.join(self.tmp_dir, META_FILE), self.meta.to_json())
            entries.update(digest_files(self.tmp_dir, [META_FILE]))
            write_manifest(self.tmp_dir, entries)
            fsync_tree(self.tmp_dir)
            _check_listing(self.tmp_dir, entries, exact=True)
            _replace_tag(self.save_dir, self.tmp_dir, self.final_dir)
            write_text_atomic(os.path.join(self.save_dir, LATEST_FILE), self.tag)
            fsync_dir(self.save_dir)
            _prune(self.save_dir, self.keep_last, self.tag)

        _agree(_attempt(finish) if self.pctx.rank == 0 else None, self.where, self.tmp_dir, self.pctx)


def _check_listing(tag_dir: str, entries: dict, exact: bool) -> None:
    """The tag's listing (rank 0's) shows every file the ranks hashed, and with ``exact`` no file the manifest
    lacks: a listing that disagrees (a stale NFS directory cache, a writer still adding files) would publish a tag
    whose manifest does not describe it."""
    listed = set(tag_files(tag_dir))
    unseen = sorted(set(entries) - listed)
    extra = sorted(listed - set(entries)) if exact else []
    if unseen or extra:
        detail = (f"lacks {', '.join(unseen[:3])}, which the ranks wrote" if unseen else
                  f"shows {', '.join(extra[:3])}, which the manifest lacks")
        raise OSError(f"the listing of {tag_dir} {detail} (a stale directory listing?)")


def _attempt(action) -> str | None:
    """Run ``action``; the one-line reason it failed (an OSError, or torch's zip writer failing, which reports
    no errno: a short write), or None."""
    try:
        action()
    except (OSError, RuntimeError) as exc:
        return write_failure_line(exc)
    return None


def _agree(error: str | None, where: str, tmp_dir: str, pctx) -> None:
    """Every rank learns whether any failed; then the partial save is removed and all raise the same line."""
    _agree_gathered(all_gather_objects(error), where, tmp_dir, pctx)


def _agree_gathered(errors: list, where: str, tmp_dir: str, pctx) -> None:
    """:func:`_agree` with every rank's error gathered (``errors[rank]``)."""
    failed = [(rank, e) for rank, e in enumerate(errors) if e]
    if not failed:
        return
    if pctx.rank == 0:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    barrier()
    rank, reason = failed[0]
    save_dir = os.path.dirname(tmp_dir)
    latest = os.path.join(save_dir, LATEST_FILE)
    kept = "nothing was saved before"
    if os.path.isfile(latest):
        with open(latest, encoding="utf-8") as fh:
            kept = f"latest still names {fh.read().strip()}"
    with contextlib.suppress(OSError):
        reason += f"; {shutil.disk_usage(save_dir).free / 2**20:,.0f} MiB free there"
    raise SaveFailed(f"saving checkpoint {where} failed on rank {rank} ({reason}); the partial save was removed and "
                     f"{kept}")


def all_gather_objects(value) -> list:
    """``value`` of every rank (one process: ``[value]``)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [value]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _replace_tag(save_dir: str, tmp_dir: str, final_dir: str) -> None:
    """Move the finished save into place. A tag saved again replaces the old one (moved aside first, so its name
    is never missing for long) and loses the universal conversion made from the old one."""
    old = None
    if os.path.isdir(final_dir):
        old = os.path.join(save_dir, f".old-{os.path.basename(final_dir)}-{os.getpid()}")
        os.replace(final_dir, old)
    os.replace(tmp_dir, final_dir)
    fsync_dir(save_dir)
    shutil.rmtree(universal_tag(final_dir), ignore_errors=True)
    if old:
        shutil.rmtree(old, ignore_errors=True)


def _prune(save_dir: str, keep_last: int, just_saved: str) -> None:
    """Keep the ``keep_last`` newest saves by save index (never the one just written, nor the one ``latest``
    names), with their universal conversions; 0 keeps every save."""
    if keep_last <= 0:
        return
    for name in saved_tags(save_dir)[keep_last:]:
        if name != just_saved:
            shutil.rmtree(os.path.join(save_dir, name), ignore_errors=True)
            shutil.rmtree(os.path.join(save_dir, universal_tag(name)), ignore_errors=True)


def load_checkpoint(engine, load_dir: str, tag: str) -> None:
    """Resume: model, optimizer and LR state through DeepSpeed, its files read by our weights-only loader. A LoRA
    checkpoint holds the adapters only (the base is loaded already), so its module state is loaded non-strictly;
    preflight has checked that it holds exactly this run's adapters."""
    groups = [{key: group[key] for key in _GROUP_STRUCTURE if key in group} for group in engine.optimizer.param_groups]
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
        _repair_universal_optimizer(engine.optimizer, groups)
        _fit_scheduler(engine.engine.lr_scheduler, len(groups))


# what tells our param groups apart (training/engine/optimizer.py): weight decay, and DeepSpeed's name and mark of
# an expert group; everything else (learning rate, betas, eps) is the same in every group
_GROUP_STRUCTURE = ("weight_decay", "name", "moe")


def _repair_universal_optimizer(optimizer, groups: list[dict]) -> None:
    """Undo the slips of DeepSpeed 0.19.8's universal loaders. They copy the saved param groups' settings onto this
    run's groups by position, and the groups of another expert degree are others (DeepSpeed's own per expert group:
    ``ep_size_2`` saved, ``ep_size_4`` now; none at EP 1): a group may get another's name and mark, or nothing at all
    (one more group than saved: the learning rate it was built with). ZeRO-3's gives every group group 0's weight
    decay, and one Adam ``step`` tensor to every group, so the step count advances once per group per step. So every
    group takes group 0's loaded settings and gets back its own ``_GROUP_STRUCTURE``, and each state its own step."""
    loaded = {key: value for key, value in optimizer.param_groups[0].items()
              if key not in ("params", *_GROUP_STRUCTURE)}
    for group, kept in zip(optimizer.param_groups, groups):
        group.update(loaded)
        for key in _GROUP_STRUCTURE:
            if key in kept:
                group[key] = kept[key]
            else:
                group.pop(key, None)
    for state in optimizer.optimizer.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].clone()


def _fit_scheduler(scheduler, count: int) -> None:
    """The LR schedule's per-group lists (one per saved group) for this run's ``count`` groups: they are the same
    schedule in every group (``_GROUP_STRUCTURE``)."""
    for key in ("base_lrs", "_last_lr"):
        values = getattr(scheduler, key, None)
        if isinstance(values, list) and values and len(values) != count:
            setattr(scheduler, key, [values[0]] * count)
