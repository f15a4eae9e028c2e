"""Stopping a run on request: the signals of ``train.stop_signals`` (SIGTERM, which SLURM and Kubernetes send before
they kill a job, SIGUSR1, SIGINT) and the wall-clock budget ``train.max_minutes`` make every rank finish its
current step; the run then saves a checkpoint and exits 0 (training/run/loop.py), and the same command with
``checkpoint.load: "auto"`` continues exactly where it stopped.

A handler only notes the signal: it may reach some ranks only, or reach them during different steps. At the end
of every step the ranks take the largest request over the world, one all-reduce of one integer on a CPU (gloo)
group so that a GPU step is not synchronised for it, and all of them stop after the same step. A second SIGINT
while the first is pending interrupts at once (KeyboardInterrupt: one line, exit 130, no save).

A signal sent to the launcher alone (``kill PID``, Kubernetes' SIGTERM to a container's first process) does not
always reach the ranks: the deepspeed runner forwards none to its ``launch.py`` (only its pdsh launcher does), so
the ranks would train on as orphans holding the save dir. Each rank therefore watches the launchers above it
(:func:`~llama_megatron.parallel.placement.launcher_chain`) from a daemon thread, once a second; one that has
exited is a stop request like a signal: the step ends, the run saves and exits 0, and ``launch.py`` (left
running) exits with its ranks.
"""

from __future__ import annotations

import signal
import threading
import time

import torch
import torch.distributed as dist

from llama_megatron.parallel.placement import LauncherProcess, launcher_gone

TIME_BUDGET = 1000  # request code of the wall-clock budget (signal requests are the signal numbers)
LAUNCHER_GONE = 1001  # request code of a launcher that exited
LAUNCHER_CHECK_S = 1.0  # how often the launchers are looked at (a few /proc reads)


class StopRequests:
    def __init__(self, signals: tuple[str, ...], max_minutes: float | None,
                 launchers: tuple[LauncherProcess, ...] = ()) -> None:
        self.deadline = None if max_minutes is None else time.monotonic() + 60.0 * max_minutes
        self.max_minutes = max_minutes
        self._received = 0
        self._previous: dict[int, object] = {}
        if threading.current_thread() is threading.main_thread():
            for name in signals:
                number = getattr(signal, name)
                self._previous[number] = signal.signal(number, self._handle)
        self._group = None
        if dist.is_available() and dist.is_initialized() and dist.get_backend() != "gloo":
            self._group = dist.new_group(backend="gloo")  # every rank creates it here, in the same order
        self._gone: LauncherProcess | None = None
        self._launchers = launchers
        self._closed = threading.Event()
        if launchers:
            threading.Thread(target=self._watch, name="launcher-watch", daemon=True).start()

    def _watch(self) -> None:
        while not self._closed.wait(LAUNCHER_CHECK_S):
            gone = launcher_gone(self._launchers)
            if gone is not None:
                self._gone = gone  # a request of its own: a first SIGINT after it is still the first
                return

    def _handle(self, signum: int, frame) -> None:
        if signum == signal.SIGINT and self._received:
            raise KeyboardInterrupt
        self._received = self._received or signum

    def poll(self) -> str | None:
        """After a step, on every rank: why the run stops now (the same answer on every rank), or None."""
        code = self._received or (LAUNCHER_GONE if self._gone is not None else 0)
        if not code and self.deadline is not None and time.monotonic() >= self.deadline:
            code = TIME_BUDGET
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            agreed = torch.tensor([code], dtype=torch.int64)
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=self._group)
            code = int(agreed.item())
        if not code:
            return None
        if code == TIME_BUDGET:
            return f"the time budget (train.max_minutes {self.max_minutes:g})"
        if code == LAUNCHER_GONE:
            # another rank may have seen it first: look now (None where it is another node's launcher)
            gone = self._gone or launcher_gone(self._launchers)
            return "its launcher's exit" + (f" ({gone.program}, pid {gone.pid})" if gone else "")
        return signal.Signals(code).name

    def close(self) -> None:
        """Restore the handlers that were there before; stop watching the launchers."""
        self._closed.set()
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous.clear()
