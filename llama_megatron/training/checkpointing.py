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

import contextlib
import errno
import fcntl
import os
import re
import shutil
import socket
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from llama_megatron.checkpoint.atomic import reclaim_temps, write_text_atomic
from llama_megatron.checkpoint.direct_io import save_direct
from llama_megatron.checkpoint.manifest import (
    digest_files,
    fsync_dir,
    fsync_tree,
    tag_files,
    verify_tag,
    write_manifest,
)
from llama_megatron.checkpoint.meta import (
    LATEST_FILE,
    META_FILE,
    TMP_PREFIX,
    CheckpointMeta,
    next_save_index,
    read_latest,
    read_meta,
    saved_tags,
    step_tag,
    universal_tag,
)
from llama_megatron.checkpoint.safe_load import (
    load_state_file,
    load_through_safe_engine,
    verify_checkpoint_dir,
)
from llama_megatron.checkpoint.universal import universal_checkpoint_info
from llama_megatron.errors import CheckpointError, ConfigError, SaveFailed
from llama_megatron.parallel.launch import barrier
from llama_megatron.training.background_save import BackgroundSaves, DirectEngine, write_failure_line
from llama_megatron.training.config import AUTO_LOAD, CheckpointConfig, TrainingConfig


def resolve_load_dir(cfg: CheckpointConfig) -> str | None:
    """The directory to load: ``checkpoint.load``, or for ``"auto"`` ``checkpoint.save`` once it holds a
    checkpoint (None: nothing saved yet, start fresh)."""
    if cfg.load != AUTO_LOAD:
        return cfg.load
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


class SaveDirLock:
    """``checkpoint.save`` owned by one run at a time: rank 0 holds an exclusive ``flock`` on ``.lock`` in it for
    the whole run. The kernel drops the lock when the process ends, so a crashed run never leaves it stuck. The file
    names the holder (host, pid, start) for the message the next run prints.

    Where the file system refuses ``flock`` (ENOLCK, EOPNOTSUPP: Lustre mounted without ``-o flock``, some NFS
    setups) the run says so in one line and owns the dir by ``.lock.owner`` instead: created exclusively, naming
    the holder, its mtime touched every ``HEARTBEAT_S`` by a thread; another run refuses the dir while the heartbeat
    is fresh and takes over one older than ``STALE_S`` (its holder was killed: nothing removed the file). Both
    files are opened without following symlinks: a link planted there would have its target truncated."""

    FILE = ".lock"
    OWNER_FILE = ".lock.owner"
    HEARTBEAT_S = 30.0
    STALE_S = 300.0  # ten missed heartbeats: generous against clock skew between the hosts sharing the dir

    def __init__(self, save_dir: str) -> None:
        self.path = os.path.join(save_dir, self.FILE)
        self.owner_path = os.path.join(save_dir, self.OWNER_FILE)
        self.note: str | None = None  # the one line saying how the dir is owned, when not by flock
        self._fh = None
        self._owner_text: str | None = None
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None

    @staticmethod
    def _holder_text() -> str:
        return f"pid {os.getpid()} on host {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}"

    def _open(self, path: str, flags: int) -> int:
        try:
            return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise ConfigError(f"{path} is a symbolic link: remove it (the save dir's lock is never followed "
                                  "through a link)") from None
            raise

    def acquire(self) -> str | None:
        """None when taken; else who holds it."""
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        fh = os.fdopen(self._open(self.path, os.O_RDWR | os.O_CREAT), "r+", encoding="utf-8")
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            holder = fh.read().strip() or "unknown"
            fh.close()
            return holder
        except OSError as exc:
            fh.close()
            if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
            self.note = (f"{os.path.dirname(self.path)}: the file system refuses flock ({errno.errorcode[exc.errno]}); "
                         f"the run owns it by {self.OWNER_FILE} with a heartbeat every {self.HEARTBEAT_S:g} s instead")
            return self._acquire_owner_file()
        fh.seek(0)
        fh.truncate()
        fh.write(self._holder_text() + "\n")
        fh.flush()
        self._fh = fh
        return None

    def _acquire_owner_file(self) -> str | None:
        text = self._holder_text()
        for _ in range(2):
            try:
                fd = self._open(self.owner_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
            except FileExistsError:
                try:
                    with open(self._open(self.owner_path, os.O_RDONLY), encoding="utf-8") as fh:
                        holder = fh.read().strip() or "unknown"
                    age = time.time() - os.stat(self.owner_path).st_mtime
                except FileNotFoundError:
                    continue  # released meanwhile
                if age < self.STALE_S:
                    return f"{holder}; heartbeat {age:.0f} s ago"
                # a killed holder's file: move it aside (one of several runs taking over wins the rename)
                aside = f"{self.owner_path}.stale.{os.getpid()}"
                try:
                    os.rename(self.owner_path, aside)
                except FileNotFoundError:
                    continue
                os.remove(aside)
                continue
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                fh.write(text + "\n")
            self._owner_text = text
            self._heartbeat = threading.Thread(target=self._beat, name="save-dir-heartbeat", daemon=True)
            self._heartbeat.start()
            return None
        return "unknown (another run took the lock file over at the same time)"

    def _beat(self) -> None:
        while not self._stop.wait(self.HEARTBEAT_S):
            with contextlib.suppress(OSError):
                os.utime(self.owner_path)

    def release(self) -> None:
        if self._fh is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self._fh, fcntl.LOCK_UN)
            self._fh.close()
            self._fh = None
        if self._owner_text is not None:
            self._stop.set()
            if self._heartbeat is not None:
                self._heartbeat.join()
            with contextlib.suppress(OSError), open(self.owner_path, encoding="utf-8") as fh:
                mine = fh.read().strip() == self._owner_text
            if mine:
                with contextlib.suppress(OSError):
                    os.remove(self.owner_path)
            self._owner_text = None


# What a killed save leaves in the save dir: its tag's temp dir, a replaced tag moved aside, temp `latest` files.
_SAVE_TEMPS = (rf"{re.escape(TMP_PREFIX)}global_step\d+|\.old-global_step\d+-(?P<pid>\d+)|"
               rf"{LATEST_FILE}\.tmp\..*")


def take_save_dir(cfg: CheckpointConfig, load_dir: str | None, pctx, log) -> SaveDirLock | None:
    """Rank 0 takes ``checkpoint.save`` for this run; every rank learns the outcome (a held lock is one line on
    every rank). With ``checkpoint.overwrite`` a run that does not continue the dir then removes its checkpoints."""
    if not cfg.save:
        return None
    lock = SaveDirLock(cfg.save)
    holder = lock.acquire() if pctx.rank == 0 else None
    holder, note = all_gather_objects((holder, lock.note))[0]
    if holder is not None:
        raise ConfigError(f"checkpoint.save {cfg.save} is in use by another run ({holder}): one run at a time "
                          "writes a save dir")
    if note:
        log.info(f"note: checkpoint.save {note}")
    if pctx.rank == 0:
        # this run owns the dir now: whatever temps are there, a killed save (SIGKILL: nothing cleaned up) left
        reclaimed = reclaim_temps(cfg.save, _SAVE_TEMPS, only_dead=False)
        if reclaimed:
            log.info(f"removed what killed saves left in {cfg.save}: {', '.join(sorted(reclaimed))}")
    if cfg.overwrite and not resumes_save_dir(cfg, load_dir):
        removed = _remove_checkpoints(cfg.save) if pctx.rank == 0 else 0
        barrier()
        if removed:
            log.info(f"checkpoint.overwrite: removed {removed} checkpoint(s) of an earlier run from {cfg.save}")
    return lock


def _remove_checkpoints(save_dir: str) -> int:
    names = saved_tags(save_dir)
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(save_dir, LATEST_FILE))
    for name in names:
        shutil.rmtree(os.path.join(save_dir, name), ignore_errors=True)
        shutil.rmtree(os.path.join(save_dir, universal_tag(name)), ignore_errors=True)
    return len(names)


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


RNG_FILE = "rng_state_rank{:05d}.pt"


def _rng_state() -> dict:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


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
                    progress: Callable[[], None] | None = None) -> str | PendingSave:
    """Write ``meta``'s tag: DeepSpeed's files and each rank's RNG state into ``.tmp-<tag>``, every file hashed
    (SHA-256) as its rank writes it around the page cache, and fsynced; the manifest and metadata, then the rename,
    ``latest`` and retention (rank 0), each directory fsynced. A failure on any rank (a full disk, an I/O error) is seen by all:
    the temporary directory is removed and :class:`SaveFailed` is raised with one line; ``latest`` and the tags
    already there are untouched. With ``background`` (``checkpoint.async_save``) the files are copied to host
    memory and written by a thread: the :class:`PendingSave` returned finishes the same way once every rank's
    writer is done. ``progress`` is called as files are hashed (the watchdog's beat)."""
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
        state = _rng_state()
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
        {rng_file: save_direct(_rng_state(), os.path.join(tmp_dir, rng_file))}))
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
