"""Names that the processes of one job share on one host, before (or without) any process group: Linux abstract
unix sockets. Binding one is atomic (exactly one process gets a name, the others are refused), it needs no file and
leaves none (the kernel drops the name when its holder exits, however it exits), and only processes of this host's
network namespace see it.

Two uses: the first rank that reports an error holds a name so the others stay silent (:mod:`llama_megatron.errors`),
and rank 0 tells the other ranks of its launcher which port it serves the rendezvous on when the launcher's port is
taken (:mod:`llama_megatron.parallel.job_store`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import sys
import time

PREFIX = "llama-megatron"


def supported() -> bool:
    """Abstract unix socket names exist on Linux only."""
    return sys.platform.startswith("linux")


def launcher_key() -> str:
    """What the local ranks of one launch share: their parent (deepspeed's launch.py, torchrun's agent, slurmstepd)."""
    return str(os.getppid())


def claim(name: str) -> socket.socket | None:
    """Hold ``name`` on this host: a listening socket while this process keeps it open (or lives), or None where
    another process holds it already."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(f"\0{PREFIX}/{name}")
        sock.listen(64)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            return None
        raise
    return sock


def ask(name: str, timeout_s: float = 5.0) -> bytes | None:
    """Connect to the holder of ``name`` and read what it sends until it closes (empty when it sends nothing); None
    where no process holds the name (or it did not answer within ``timeout_s``)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_s)
        try:
            sock.connect(f"\0{PREFIX}/{name}")
            chunks = []
            while chunk := sock.recv(4096):
                chunks.append(chunk)
        except OSError:
            return None
    return b"".join(chunks)


def answer(holder: socket.socket, payload: bytes, count: int, deadline_s: float) -> int:
    """Send ``payload`` to each of up to ``count`` processes that connect to ``holder`` within ``deadline_s``;
    how many did."""
    end = time.monotonic() + deadline_s
    served = 0
    while served < count and (left := end - time.monotonic()) > 0:
        holder.settimeout(left)
        try:
            conn, _ = holder.accept()
        except (TimeoutError, OSError):
            break
        with conn, contextlib.suppress(OSError):
            conn.sendall(payload)
        served += 1
    return served
