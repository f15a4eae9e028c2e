"""``checkpoint.save`` owned by one run at a time (:class:`SaveDirLock`), and taken for a run as it starts
(:func:`take_save_dir`): what killed saves left there reclaimed, an earlier run's checkpoints removed under
``checkpoint.overwrite``."""

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

from llama_megatron.checkpoint.atomic import reclaim_temps
from llama_megatron.checkpoint.directory import LATEST_FILE, TMP_PREFIX, saved_tags, universal_tag
from llama_megatron.errors import ConfigError
from llama_megatron.parallel.process_groups import barrier
from llama_megatron.training.checkpointing import all_gather_objects
from llama_megatron.training.config import CheckpointConfig
from llama_megatron.training.resume import resumes_save_dir


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
