"""A stalled rank ends the job instead of hanging it: ``distributed.timeout_minutes``.

When one rank stops (a hung GPU, a host paused or swapping, a dead NIC), every other rank waits in its next
collective; NCCL's and gloo's own timeouts then end the job with a C++ abort or a traceback per rank, or, in
groups DeepSpeed makes, after their 30-minute default. Here each rank's main thread marks its progress (the step and
what it is doing: :meth:`StallWatchdog.beat`, a few attribute writes) and a daemon thread checks it: with no
progress for the timeout, the rank writes one line naming the step, what it was doing, its pipeline stage and the
ranks that went silent, then exits 5 at once (its main thread is blocked inside the collective and cannot raise).
The launcher then ends the ranks left, the stopped one included.

To name the silent ranks, the thread publishes this rank's progress every few seconds to the job's rendezvous store
(the TCPStore at MASTER_ADDR:MASTER_PORT every launcher sets up) under its own keys; a rank whose entry stopped
changing is the one to look at. A store that does not answer is named instead: the rank that hosts it (rank 0 under
the deepspeed launcher) is then the stopped one, or its host is gone.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import sys
import threading
import time

from llama_megatron.errors import Stalled, print_error

KEY = "llama_megatron/progress/{rank}"


class StallWatchdog:
    """Exit 5 with one line when this rank makes no progress for ``timeout_minutes``."""

    def __init__(self, timeout_minutes: float, rank: int, world_size: int, pipeline_stage: tuple[int, int],
                 store_address: tuple[str, int] | None = None) -> None:
        self.timeout = 60.0 * timeout_minutes
        self.rank, self.world_size, self.stage = rank, world_size, pipeline_stage
        self.host = socket.gethostname()
        self.step, self.doing = 0, "starting"
        self._last = time.monotonic()
        self._interval = max(0.5, min(self.timeout / 4, 10.0))  # how often the thread looks and publishes
        self._address = store_address
        self._store = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="stall-watchdog", daemon=True)
        self._thread.start()

    def beat(self, step: int, doing: str) -> None:
        """Progress: this rank is now at ``step``, doing ``doing`` (main thread; no I/O)."""
        self.step, self.doing, self._last = step, doing, time.monotonic()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self._interval + 1)

    def _watch(self) -> None:
        self._publish()
        while not self._stop.wait(self._interval):
            self._publish()
            idle = time.monotonic() - self._last
            if idle > self.timeout and not self._stop.is_set():
                self._expire(idle)

    def _expire(self, idle: float) -> None:
        stage, stages = self.stage
        where = f", pipeline stage {stage + 1} of {stages}" if stages > 1 else ""
        message = (f"stalled at step {self.step} ({self.doing}{where}) on rank {self.rank} "
                   f"({self.host}): no progress for {idle:.0f} s (distributed.timeout_minutes "
                   f"{self.timeout / 60:g}); {self._silent_ranks()}")
        sys.stdout.flush()
        print_error(message)
        if self.rank == 0:
            # under the deepspeed launcher rank 0 hosts the store: the others, stalled at about the same moment,
            # read it for their own line before it goes
            time.sleep(2 * self._interval)
        os._exit(Stalled.exit_code)

    # ---- the rendezvous store: who went silent ----
    def _connect(self):
        if self._store is None and self._address is not None and self.world_size > 1:
            import torch.distributed as dist

            host, port = self._address
            self._store = dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                                        timeout=datetime.timedelta(seconds=max(2.0, self._interval)))
        return self._store

    def _publish(self) -> None:
        try:
            store = self._connect()
            if store is not None:
                store.set(KEY.format(rank=self.rank), json.dumps(
                    {"step": self.step, "doing": self.doing, "host": self.host, "at": time.time()}))
        except Exception:  # noqa: BLE001 - a store that does not answer is reported when the timeout ends
            self._store = None

    def _silent_ranks(self) -> str:
        """Which ranks stopped reporting, read from the store (bounded by its timeout)."""
        if self._address is None or self.world_size == 1:
            return "one process"
        try:
            store = self._connect()
            keys = [KEY.format(rank=r) for r in range(self.world_size)]
            present = [k for k in keys if store.check([k])]
            reports = {int(k.rsplit("/", 1)[1]): json.loads(store.get(k)) for k in present}
        except Exception:  # noqa: BLE001
            host, port = self._address
            return (f"the rendezvous store at {host}:{port} does not answer either: the process that hosts it "
                    "(rank 0 under the deepspeed launcher) has stopped, or its host is unreachable")
        now, stale_after = time.time(), 3 * self._interval
        silent = [f"rank {r} ({reports[r]['host']}, last heard {now - reports[r]['at']:.0f} s ago at step "
                  f"{reports[r]['step']}, {reports[r]['doing']})"
                  for r in sorted(reports) if now - reports[r]["at"] > stale_after]
        silent += [f"rank {r} (never reported)" for r in range(self.world_size) if r not in reports]
        if not silent:
            return "every rank still reports: a collective is stuck (check the network / NCCL environment)"
        return "silent: " + "; ".join(silent)
