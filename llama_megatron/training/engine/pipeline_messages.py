"""The messages of our pipeline engine (training/engine/pipeline_engine.py): what an activation header carries (the
dtypes it names by position, at most ``MAX_TENSORS`` tensors of ``MAX_DIMS`` dimensions), the two kinds of message
(an activation forward, a gradient back), a receive the step expects, and the asynchronous sends, each let go as it
completes.
"""

from __future__ import annotations

import queue
import threading

import torch

from llama_megatron.training.pipeline import instructions as ins

# the dtypes an activation header names (by position)
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.bool,
           torch.uint8)
MAX_TENSORS, MAX_DIMS = 8, 6
HEADER = 2 + MAX_TENSORS * (2 + MAX_DIMS)  # count, tuple?, then per tensor: dtype, dims, shape
ACTIVATION, GRADIENT = 0, 1
RECEIVES = {ins.RecvActivation: ACTIVATION, ins.RecvGrad: GRADIENT}


class Sends:
    """This rank's asynchronous sends, each let go (its tensor freed) as soon as it completes: a thread waits on
    them in the order they were made, since gloo's work reports its completion only to ``wait`` (``is_completed``
    stays false until then), and a list waited on at the end of the step would hold every activation and gradient
    the step sent."""

    def __init__(self) -> None:
        self._queue: queue.Queue = queue.Queue()
        self._live: dict[int, torch.Tensor] = {}
        self._lock = threading.Lock()
        self._count = 0
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def add(self, work, tensor: torch.Tensor) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._complete, name="pipeline-sends", daemon=True)
            self._thread.start()
        with self._lock:
            self._count += 1
            self._live[self._count] = tensor
        self._queue.put((work, self._count))

    def _complete(self) -> None:
        while True:
            work, key = self._queue.get()
            try:
                work.wait()  # releases the GIL
            except BaseException as error:  # noqa: BLE001 - raised in the training thread by wait_all
                self._error = error
            with self._lock:
                del self._live[key]
            self._queue.task_done()

    def tensors(self) -> list[torch.Tensor]:
        """The tensors of the sends not complete yet (held memory)."""
        with self._lock:
            return list(self._live.values())

    def wait_all(self) -> None:
        """Every send made so far complete (the end of a step); a send's failure raised here."""
        self._queue.join()
        error, self._error = self._error, None
        if error is not None:
            raise error


class Receive:
    """A message this rank expects in the step (a micro batch's activation or gradient across a stage boundary
    from ``peer``), and the receives posted for it."""

    __slots__ = ("kind", "buffer", "boundary", "micro_batch", "peer", "posted", "works", "tensors")

    def __init__(self, kind: int, buffer: int, boundary: int, micro_batch: int, peer: int) -> None:
        self.kind, self.buffer, self.boundary, self.micro_batch, self.peer = kind, buffer, boundary, micro_batch, peer
        self.posted, self.works, self.tensors = False, [], []
