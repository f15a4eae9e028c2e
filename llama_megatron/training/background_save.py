"""How a save's files are written: around the page cache and hashed as written, and for an asynchronous save
(``checkpoint.async_save``) in the background, from a copy that lets training go on.

Every save writes what DeepSpeed's torch checkpoint engine would, through :func:`write_state` (checkpoint/
direct_io.py: ``O_DIRECT``, each file's SHA-256 computed as it is written, so no file is read back for the
manifest); a synchronous save swaps in :class:`DirectEngine`. An asynchronous one swaps in :class:`SnapshotEngine`:
each state dict is captured (:class:`HostSnapshots`: its numbers and lists copied at once, each tensor given a host
buffer kept and reused by the next save, pinned for a GPU's tensors) and handed to :class:`BackgroundWriter`, one
thread that first copies every captured tensor into its buffer, then writes the files in order. Training goes on as
soon as the state is captured: the next step's forward and backward passes read the weights but change neither
them nor the optimizer state, so the copy runs beside them and only the next optimizer step waits for it
(:meth:`BackgroundWriter.wait_copied`, called by the engine right before its model step:
training/engine/step_fence.py), as torchtitan's pinned-memory async checkpoint waits for its staging. The manifest,
the rename and ``latest`` wait until every rank's writer is done (training/checkpointing.py, ``PendingSave``).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from llama_megatron.checkpoint.direct_io import save_direct
from llama_megatron.checkpoint.manifest import digest_files


class HostSnapshots:
    """Host copies of state dicts in buffers reused across saves (a save copies into the previous save's buffers,
    which is why at most one save is in flight). :meth:`capture` takes a state dict's structure at the save point,
    :meth:`fill` copies its tensors into their buffers later (the writer thread)."""

    def __init__(self) -> None:
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # (buffer, the tensor to copy into it)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._buffers.values())

    def capture(self, obj: Any, key: tuple) -> Any:
        """``obj`` with every tensor replaced by its host buffer (filled by :meth:`fill`) and everything else
        deep-copied now (a state dict's lists and numbers change as training goes on)."""
        if isinstance(obj, torch.Tensor):
            slot = (key, obj.dtype, tuple(obj.shape))
            buffer = self._buffers.get(slot)
            if buffer is None:
                buffer = torch.empty(obj.shape, dtype=obj.dtype, pin_memory=obj.is_cuda)
                self._buffers[slot] = buffer
            self._pending.append((buffer, obj.detach()))
            return buffer
        if isinstance(obj, dict):
            return type(obj)((k, self.capture(v, (*key, k))) for k, v in obj.items())
        if isinstance(obj, (list, tuple)):
            items = [self.capture(v, (*key, i)) for i, v in enumerate(obj)]
            if hasattr(obj, "_fields"):  # a namedtuple
                return type(obj)(*items)
            return type(obj)(items)
        return copy.deepcopy(obj)

    def fill(self) -> None:
        """Copy every captured tensor into its buffer, and let the tensors go."""
        pending, self._pending = self._pending, []
        for buffer, source in pending:
            buffer.copy_(source, non_blocking=source.is_cuda)
        if any(source.is_cuda for _, source in pending):
            torch.cuda.synchronize()  # the copies were queued without waiting: done before they are written

    def discard(self) -> None:
        """Forget what was captured (a save that failed while DeepSpeed was still handing over its state)."""
        self._pending = []


class BackgroundWriter:
    """One thread running the queued work in order: a save's host copy first (:meth:`copy`), then its writes, each
    file fsynced and hashed (its manifest entry). The first failure is kept (the work after it is skipped) for the
    training thread to report."""

    def __init__(self) -> None:
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._copied = threading.Event()
        self._copied.set()
        self.digests: dict[str, dict] = {}
        self.error: str | None = None

    def _put(self, item: tuple) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="checkpoint-writer", daemon=True)
            self._thread.start()
        self._queue.put(item)

    def copy(self, fill: Callable[[], None]) -> None:
        """Run ``fill`` (the host copy) before the writes queued after it; :meth:`wait_copied` waits for it."""
        self._copied.clear()
        self._put((fill, None, None))

    def submit(self, write: Callable[[], dict], tag_dir: str, name: str) -> None:
        """Queue ``write`` of ``tag_dir/name``: it returns the file's manifest entry, the file fsynced
        (:func:`write_state`, :func:`~llama_megatron.checkpoint.direct_io.save_direct`)."""
        self._put((write, tag_dir, name))

    def _run(self) -> None:
        while True:
            work, tag_dir, name = self._queue.get()
            try:
                if self.error is None:
                    entry = work()
                    if name is not None:
                        self.digests[name] = entry
            except Exception as exc:  # noqa: BLE001 - reported by the training thread, one line
                self.error = write_failure_line(exc)
            finally:
                if name is None:
                    self._copied.set()  # a failed copy too: its error ends the run at the next step boundary
                self._queue.task_done()

    def wait_copied(self) -> None:
        """Return once the save in flight no longer needs the weights and optimizer state as they were (its host
        copy is made): what the engine calls before it changes them."""
        self._copied.wait()

    def done(self) -> bool:
        return self._queue.unfinished_tasks == 0

    def wait(self) -> None:
        self._queue.join()

    def reset(self) -> None:
        """Forget the finished save's digests and error (a new save begins)."""
        self.wait()
        self.digests, self.error = {}, None


def write_failure_line(exc: BaseException) -> str:
    """The one line a failed write of a save is reported with: the OS's reason, or for torch's zip writer, which
    reports a short write without an errno, what it means."""
    if isinstance(exc, OSError):
        return os.strerror(exc.errno) if exc.errno else str(exc).strip().splitlines()[0]
    if any(mark in str(exc) for mark in ("PytorchStreamWriter", "inline_container", "file write failed")):
        return "a file could not be written completely (disk full, or a file size limit)"
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def write_state(inner: Any, state_dict: Any, path: str, progress: Callable[[], None] | None = None) -> dict:
    """What DeepSpeed's torch checkpoint engine ``inner`` writes, written around the page cache and hashed as it
    goes (:func:`save_direct`): the file's manifest entry. Another engine (a user's writer) writes as it does, and
    the file is hashed and fsynced by reading it back."""
    serialization = getattr(inner, "zipfile_serialization", None)
    if getattr(inner, "name", None) != "TorchCheckpointEngine" or serialization is None:
        inner.save(state_dict, path)
        name = os.path.basename(path)
        return digest_files(os.path.dirname(path), [name], True, progress)[name]
    return save_direct(state_dict, path, serialization, progress)


class DirectEngine:
    """DeepSpeed's checkpoint engine, with ``save`` writing through :func:`write_state` (a synchronous save) and
    keeping each file's manifest entry in ``digests`` (everything else passes through to the engine it wraps)."""

    def __init__(self, inner: Any, progress: Callable[[], None] | None = None) -> None:
        self._inner, self._progress = inner, progress
        self.digests: dict[str, dict] = {}

    def save(self, state_dict: Any, path: str) -> None:
        self.digests[os.path.basename(path)] = write_state(self._inner, state_dict, path, self._progress)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    @contextlib.contextmanager
    def installed(self, ds_engine: Any) -> Iterator[DirectEngine]:
        """``ds_engine.save_checkpoint`` writes through this engine while inside."""
        ds_engine.checkpoint_engine = self
        try:
            yield self
        finally:
            ds_engine.checkpoint_engine = self._inner


class SnapshotEngine:
    """DeepSpeed's checkpoint engine, with ``save`` capturing the state dict for the writer (everything else passes
    through to the engine it wraps)."""

    def __init__(self, inner: Any, snapshots: HostSnapshots) -> None:
        self._inner, self._snapshots = inner, snapshots
        self.captured: list[tuple[Any, str]] = []  # (snapshot, path), in DeepSpeed's order

    def save(self, state_dict: Any, path: str) -> None:
        self.captured.append((self._snapshots.capture(state_dict, (os.path.basename(path),)), path))

    def commit(self, info: Any) -> bool:
        return True  # the tag is committed by our finish, once every rank's files are written

    def preserves_storage_sharing(self) -> bool:
        # False: DeepSpeed then skips its clone of each state dict before ``save`` (a second copy of the weights,
        # made while training waits). The host copy already gives each tensor a compact buffer of its own, which is
        # what that clone is for (a view saved without the whole storage behind it).
        return False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class BackgroundSaves:
    """A run's asynchronous saving: its host buffers and its writer thread."""

    def __init__(self) -> None:
        self.snapshots = HostSnapshots()
        self.writer = BackgroundWriter()

    @contextlib.contextmanager
    def capturing(self, ds_engine: Any) -> Iterator[None]:
        """``ds_engine.save_checkpoint`` captures instead of writing, while inside; on leaving, the host copy and
        the writes are queued (nothing is, if the save raised)."""
        inner = ds_engine.checkpoint_engine
        engine = ds_engine.checkpoint_engine = SnapshotEngine(inner, self.snapshots)
        try:
            yield
        except BaseException:
            self.snapshots.discard()
            raise
        else:
            self.writer.copy(self.snapshots.fill)
            for snapshot, path in engine.captured:
                self.writer.submit(functools.partial(write_state, inner, snapshot, path), os.path.dirname(path),
                                   os.path.basename(path))
        finally:
            ds_engine.checkpoint_engine = inner
