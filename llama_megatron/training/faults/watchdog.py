"""A stalled rank ends the job instead of hanging it: ``distributed.timeout_minutes``.

When one rank stops (a hung GPU, a host paused or swapping, a dead NIC), every other rank waits in its next
collective; NCCL's and gloo's own timeouts then end the job with a C++ abort or a traceback per rank, or, in
groups DeepSpeed makes, after their 30-minute default. Here each rank's main thread marks its progress (the step and
what it is doing: :meth:`StallWatchdog.beat`, a few attribute writes) and a daemon thread checks it: with no
progress for the timeout, the rank writes one line naming the step, what it was doing, its pipeline stage and the
ranks that went silent, then exits 5 (its main thread is blocked inside the collective and cannot raise). The
first such rank marks the job as ending in the store, so every live rank writes its line before the first exits;
the launcher then ends the ranks left, the stopped one included.

To name the silent ranks, the thread publishes this rank's progress every few seconds to the job's rendezvous store
(the TCPStore at MASTER_ADDR:MASTER_PORT every launcher sets up) under its own keys; a rank whose entry stopped
changing is the one to look at. A store that does not answer is named instead: the rank that hosts it (rank 0 under
the deepspeed launcher) is then the stopped one, or its host is gone.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time

from llama_megatron.errors import Stalled, print_error
from llama_megatron.parallel.launch import rendezvous_store

KEY = "llama_megatron/progress/{rank}"
ENDING_KEY = "llama_megatron/stalled"  # set by the first rank that reached the timeout


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
            if self._stop.is_set():
                break
            if idle > self.timeout:
                self._expire(idle)
            elif (first := self._first_expired()) is not None:
                self._expire(idle, first)

    def _expire(self, idle: float, first: int | None = None) -> None:
        """This rank's line, then exit 5. The first rank to reach the timeout marks the job as ending in the store;
        the others, whose own timeouts end a check or two later, see it and write theirs now. Each waits two
        checks before it exits: the launcher ends every rank once one exits, and each rank's line is wanted."""
        if first is None:
            self._mark_ending()
        stage, stages = self.stage
        where = f", pipeline stage {stage + 1} of {stages}" if stages > 1 else ""
        also = f" - ending with rank {first}, which reached the timeout first" if first is not None else ""
        message = (f"stalled at step {self.step} ({self.doing}{where}) on rank {self.rank} "
                   f"({self.host}): no progress for {idle:.0f} s (distributed.timeout_minutes "
                   f"{self.timeout / 60:g}); {self._silent_ranks()}{also}")
        sys.stdout.flush()
        print_error(message)
        # rank 0 also hosts the store under the deepspeed launcher: the others read it for their lines meanwhile
        time.sleep(2 * self._interval)
        os._exit(Stalled.exit_code)

    def _mark_ending(self) -> None:
        try:
            store = self._connect()
            if store is not None:
                store.set(ENDING_KEY, str(self.rank))
        except Exception:  # noqa: BLE001 - the others then reach their own timeouts
            pass

    def _first_expired(self) -> int | None:
        """The rank that reached the timeout first, once one has (read from the store)."""
        try:
            store = self._connect()
            if store is not None and store.check([ENDING_KEY]):
                return int(store.get(ENDING_KEY))
        except Exception:  # noqa: BLE001 - a store that does not answer: this rank's own timeout decides
            pass
        return None

    # ---- the rendezvous store: who went silent ----
    def _connect(self):
        if self._store is None and self._address is not None and self.world_size > 1:
            self._store = rendezvous_store(max(2.0, self._interval), self._address)
        return self._store

    def _publish(self) -> None:
        try:
            store = self._connect()
            if store is not None:
                store.set(KEY.format(rank=self.rank), json.dumps(
                    {"step": self.step, "doing": self.doing, "host": self.host, "at": time.time()}))
        except TimeoutError:  # it does not answer (its host stopped): reported when the timeout ends
            pass
        except Exception:  # noqa: BLE001 - not up yet, or gone: connect again next time
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
