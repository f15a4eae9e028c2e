"""What an asynchronous save (``checkpoint.async_save``) runs in the background, and the copy that lets training go on.

A save asks DeepSpeed's engine to save as always, with its checkpoint engine swapped for :class:`SnapshotEngine`:
each state dict it would write is copied to host memory (:class:`HostSnapshots`: buffers kept and reused by the next
save, pinned for a GPU's tensors) and handed to :class:`BackgroundWriter`, one thread that writes the files in
order with DeepSpeed's own writer, fsyncs and hashes each. Training goes on once the copies are made; the manifest,
the rename and ``latest`` wait until every rank's writer is done (training/checkpointing.py, ``PendingSave``).
"""

from __future__ import annotations

import contextlib
import copy
import os
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from llama_megatron.checkpoint.manifest import digest_files


class HostSnapshots:
    """Host copies of state dicts in buffers reused across saves (a save copies into the previous save's buffers,
    which is why at most one save is in flight)."""

    def __init__(self) -> None:
        self._buffers: dict[tuple, torch.Tensor] = {}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._buffers.values())

    def copy(self, obj: Any, key: tuple) -> Any:
        """``obj`` with every tensor copied to host memory and everything else deep-copied (a state dict's lists
        and numbers change as training goes on)."""
        if isinstance(obj, torch.Tensor):
            slot = (key, obj.dtype, tuple(obj.shape))
            buffer = self._buffers.get(slot)
            if buffer is None:
                buffer = torch.empty(obj.shape, dtype=obj.dtype, pin_memory=obj.is_cuda)
                self._buffers[slot] = buffer
            buffer.copy_(obj.detach(), non_blocking=obj.is_cuda)
            return buffer
        if isinstance(obj, dict):
            return type(obj)((k, self.copy(v, (*key, k))) for k, v in obj.items())
        if isinstance(obj, (list, tuple)):
            items = [self.copy(v, (*key, i)) for i, v in enumerate(obj)]
            if hasattr(obj, "_fields"):  # a namedtuple
                return type(obj)(*items)
            return type(obj)(items)
        return copy.deepcopy(obj)


class BackgroundWriter:
    """One thread running the queued writes in order; each file written is fsynced and hashed (its manifest entry).
    The first failure is kept (the writes after it are skipped) for the training thread to report."""

    def __init__(self) -> None:
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self.digests: dict[str, dict] = {}
        self.error: str | None = None

    def submit(self, write: Callable[[], None], tag_dir: str, name: str) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="checkpoint-writer", daemon=True)
            self._thread.start()
        self._queue.put((write, tag_dir, name))

    def _run(self) -> None:
        while True:
            write, tag_dir, name = self._queue.get()
            try:
                if self.error is None:
                    write()
                    self.digests.update(digest_files(tag_dir, [name], fsync=True))
            except OSError as exc:
                self.error = os.strerror(exc.errno) if exc.errno else str(exc).strip().splitlines()[0]
            except Exception as exc:  # noqa: BLE001 - reported by the training thread, one line
                text = str(exc).strip().splitlines()
                self.error = "a file could not be written completely (disk full, or a file size limit)" if any(
                    mark in str(exc) for mark in ("PytorchStreamWriter", "inline_container", "file write failed")
                ) else f"{type(exc).__name__}: {text[0] if text else ''}"
            finally:
                self._queue.task_done()

    def done(self) -> bool:
        return self._queue.unfinished_tasks == 0

    def wait(self) -> None:
        self._queue.join()

    def reset(self) -> None:
        """Forget the finished save's digests and error (a new save begins)."""
        self.wait()
        self.digests, self.error = {}, None


class SnapshotEngine:
    """DeepSpeed's checkpoint engine, with ``save`` copying to host and queueing the write (everything else passes
    through to the engine it wraps)."""

    def __init__(self, inner: Any, snapshots: HostSnapshots, writer: BackgroundWriter) -> None:
        self._inner, self._snapshots, self._writer = inner, snapshots, writer

    def save(self, state_dict: Any, path: str) -> None:
        name = os.path.basename(path)
        snapshot = self._snapshots.copy(state_dict, (name,))
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the copies were queued without waiting: done before the thread reads them
        inner = self._inner
        self._writer.submit(lambda: inner.save(snapshot, path), os.path.dirname(path), name)

    def commit(self, info: Any) -> bool:
        return True  # the tag is committed by our finish, once every rank's files are written

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class BackgroundSaves:
    """A run's asynchronous saving: its host buffers and its writer thread."""

    def __init__(self) -> None:
        self.snapshots = HostSnapshots()
        self.writer = BackgroundWriter()

    @contextlib.contextmanager
    def capturing(self, ds_engine: Any) -> Iterator[None]:
        """``ds_engine.save_checkpoint`` copies and queues instead of writing, while inside."""
        inner = ds_engine.checkpoint_engine
        ds_engine.checkpoint_engine = SnapshotEngine(inner, self.snapshots, self.writer)
        try:
            yield
        finally:
            ds_engine.checkpoint_engine = inner
