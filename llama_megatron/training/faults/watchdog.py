"""A stalled rank ends the job instead of hanging it: ``distributed.timeout_minutes``.

When one rank stops (a hung GPU, a host paused or swapping, a dead NIC), every other rank waits in its next
collective; NCCL's and gloo's own timeouts then end the job with a C++ abort or a traceback per rank, or, in
groups DeepSpeed makes, after their 30-minute default. Here each rank's main thread marks its progress (the step and
what it is doing: :meth:`StallWatchdog.beat`, a few attribute writes) and a daemon thread checks it: with no
progress for the timeout, the rank writes one line naming the step, what it was doing, its pipeline stage and the
ranks that went silent, then exits 5 (its main thread is blocked inside the collective and cannot raise). The
first such rank marks the job as ending in the store, so every live rank writes its line before the first exits;
the launcher then ends the ranks left, the stopped one included.

To name the silent ranks, the thread publishes this rank's progress every few seconds to the job's store under its
own keys; a rank whose entry stopped changing is the one to look at. The store is the rendezvous at
MASTER_ADDR:MASTER_PORT, which rank 0 serves, or under torchrun (whose agent serves that one) a store rank 0 serves
beside it (:func:`job_store`). A store that does not answer is named instead: the rank that hosts it (rank 0) is
then the stopped one, or its host is gone.

The store has no authentication. Rank 0 listens on MASTER_ADDR only (parallel/job_store.py; torchrun's agent, which
the watchdog uses only where MASTER_ADDR gives rank 0 no address of its own, on every interface), and the keys carry
a per-job nonce that rank 0 draws and sends over the process group with the store's address, never through the
store: a client that guesses the fixed names cannot end the job. What is read back is validated, and the thread
survives anything it reads: a dead thread would leave a stalled rank hanging forever.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator

from llama_megatron.errors import Stalled, print_error
from llama_megatron.parallel.job_store import progress_store_address, rendezvous_store

KEY = "llama_megatron/{nonce}/progress/{rank}"
ENDING_KEY = "llama_megatron/{nonce}/stalled"  # set by the first rank that reached the timeout


def job_store(timeout_minutes: float) -> tuple[tuple[str, int] | None, str]:
    """The store the watchdog publishes to (:func:`progress_store_address`) and a secret every rank of this job
    shares, both rank 0's, broadcast over the process group (not the store, which anyone reaching its port can
    read). One process: its own."""
    import torch.distributed as dist

    many = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    value = [secrets.token_hex(16), progress_store_address(60.0 * timeout_minutes)
             if not many or dist.get_rank() == 0 else None]
    if many:
        dist.broadcast_object_list(value, src=0)
    return value[1], value[0]


def _progress_entry(raw: bytes) -> dict | None:
    """A rank's progress entry as published (:meth:`StallWatchdog._publish`), or None when it is not one."""
    try:
        entry = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    kinds = {"step": int, "doing": str, "host": str, "at": (int, float)}
    if not isinstance(entry, dict) or not all(isinstance(entry.get(k), t) for k, t in kinds.items()):
        return None
    return entry


class StallWatchdog:
    """Exit 5 with one line when this rank makes no progress for ``timeout_minutes``."""

    def __init__(self, timeout_minutes: float, rank: int, world_size: int, pipeline_stage: tuple[int, int],
                 store_address: tuple[str, int] | None = None, nonce: str = "") -> None:
        self.timeout = 60.0 * timeout_minutes
        self.rank, self.world_size, self.stage = rank, world_size, pipeline_stage
        self.host = socket.gethostname()
        self.step, self.doing = 0, "starting"
        self._last = time.monotonic()
        self._interval = max(0.5, min(self.timeout / 4, 10.0))  # how often the thread looks and publishes
        self._address = store_address
        self._growing: str | None = None  # a directory whose growth counts as progress (:meth:`working`)
        self._grown: tuple[int, int] | None = None
        self._key = KEY.replace("{nonce}", nonce)
        self._ending_key = ENDING_KEY.format(nonce=nonce)
        self._store = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="stall-watchdog", daemon=True)
        self._thread.start()

    def beat(self, step: int, doing: str) -> None:
        """Progress: this rank is now at ``step``, doing ``doing`` (main thread; no I/O)."""
        self.step, self.doing, self._last = step, doing, time.monotonic()

    @contextlib.contextmanager
    def working(self, step: int, doing: str, growing: str | None = None) -> Iterator[Callable[[], None]]:
        """A long phase (a save, an evaluation) that beats as it goes, so one longer than the timeout does not end
        healthy ranks: yields the beat for the main thread's own loops (a file hashed, a forward pass), and with
        ``growing`` the thread also counts growth of that directory as progress (any rank's files, on the shared
        file system), for the writes the main thread cannot beat from (DeepSpeed's own torch.save, a barrier
        while another rank writes). A rank stopped inside a collective still stops every beat and every write."""
        self.beat(step, doing)
        self._growing, self._grown = growing, None
        try:
            yield lambda: self.beat(step, doing)
        finally:
            self._growing = None

    def _note_growth(self) -> None:
        path = self._growing
        if path is None:
            return
        size = (0, 0)
        for root, _, files in os.walk(path):
            for name in files:
                with contextlib.suppress(OSError):
                    size = (size[0] + 1, size[1] + os.stat(os.path.join(root, name)).st_size)
        if size != self._grown:
            self._grown, self._last = size, time.monotonic()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self._interval + 1)

    def _watch(self) -> None:
        self._publish()
        while not self._stop.wait(self._interval):
            self._publish()
            with contextlib.suppress(Exception):  # noqa: BLE001 - a directory that vanished: no growth
                self._note_growth()
            idle = time.monotonic() - self._last
            if self._stop.is_set():
                break
            if idle > self.timeout:
                self._expire(idle)
            else:
                try:
                    first = self._first_expired()
                except Exception:  # noqa: BLE001 - whatever the store holds, the thread goes on watching
                    first = None
                if first is not None:
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
        try:
            silent = self._silent_ranks()
        except Exception as exc:  # noqa: BLE001 - the line and the exit come whatever the store held
            silent = f"the other ranks' progress could not be read ({type(exc).__name__})"
        message = (f"stalled at step {self.step} ({self.doing}{where}) on rank {self.rank} "
                   f"({self.host}): no progress for {idle:.0f} s (distributed.timeout_minutes "
                   f"{self.timeout / 60:g}); {silent}{also}")
        sys.stdout.flush()
        with contextlib.suppress(Exception):
            print_error(message)
        # rank 0 also hosts the store: the others read it for their lines meanwhile
        time.sleep(2 * self._interval)
        os._exit(Stalled.exit_code)

    def _mark_ending(self) -> None:
        try:
            store = self._connect()
            if store is not None:
                store.set(self._ending_key, str(self.rank))
        except Exception:  # noqa: BLE001 - the others then reach their own timeouts
            pass

    def _first_expired(self) -> int | None:
        """The rank that reached the timeout first, once one has (read from the store; a value that names no rank
        of this job is not a stall)."""
        try:
            store = self._connect()
            if store is not None and store.check([self._ending_key]):
                value = store.get(self._ending_key)
                if value.isdigit() and int(value) < self.world_size:
                    return int(value)
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
                store.set(self._key.format(rank=self.rank), json.dumps(
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
            raw = {r: store.get(k) for r in range(self.world_size)
                   if store.check([k := self._key.format(rank=r)])}
        except Exception:  # noqa: BLE001
            host, port = self._address
            return (f"the rendezvous store at {host}:{port} does not answer either: the process that hosts it "
                    "(rank 0) has stopped, or its host is unreachable")
        reports = {r: entry for r, value in raw.items() if (entry := _progress_entry(value)) is not None}
        now, stale_after = time.time(), 3 * self._interval
        silent = [f"rank {r} ({reports[r]['host']}, last heard {now - reports[r]['at']:.0f} s ago at step "
                  f"{reports[r]['step']}, {reports[r]['doing']})"
                  for r in sorted(reports) if now - reports[r]["at"] > stale_after]
        silent += [f"rank {r} (never reported)" for r in range(self.world_size) if r not in raw]
        silent += [f"rank {r} (its progress entry is not one of ours: {raw[r][:60]!r})" for r in sorted(raw)
                   if r not in reports]
        if not silent:
            return "every rank still reports: a collective is stuck (check the network / NCCL environment)"
        return "silent: " + "; ".join(silent)
