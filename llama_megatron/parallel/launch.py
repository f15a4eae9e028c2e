"""Process-group start-up shared by the training entry points and the multi-process tests."""

from __future__ import annotations

import os
import random
import socket
import sys

import torch


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as fh:
            return int(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    """A TCP port free on this host now, for a one-host rendezvous.

    Chosen at random just below the kernel's ephemeral range: a port the kernel handed out for ``bind(0)`` is free
    again once we close it, and any socket another job opens before the launcher binds it (gloo and NCCL open
    hundreds) may be given the same one; ports below that range are never handed out, so only another explicit
    choice can collide, one chance in thousands."""
    high = _ephemeral_low()
    low = max(1024, high - 12000)
    rng = random.SystemRandom()
    for _ in range(100):
        port = rng.randrange(low, high)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:  # every try taken: let the kernel choose
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launcher_command(num_procs: int) -> list[str]:
    """The ``deepspeed`` launcher for ``num_procs`` local processes on a free port, in its module form (a
    ``pip install --target`` of DeepSpeed has no ``deepspeed`` script); append the script or ``--module`` entry."""
    return [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(num_procs),
            "--master_port", str(free_port())]


def skip_cpu_shared_memory_op() -> bool:
    """On CPU, mark DeepSpeed's shared-memory all-reduce op (inference only; a 1-2 minute JIT build the first time a
    process group starts) incompatible so it is never built; True on CPU. Anything that lets DeepSpeed start the
    process group (HF Trainer in the benchmarks, too) calls this first."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != "cpu":
        return False
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    return True


def init_distributed(timeout_minutes: int = 30) -> None:
    """Initialise DeepSpeed's communication layer (gloo on CPU, NCCL on GPU: DeepSpeed picks).

    On CPU DeepSpeed would JIT-build its shared-memory all-reduce op (1-2 minutes) that only inference uses;
    mark it incompatible first. ``OMP_NUM_THREADS`` defaults to cores / local processes so several ranks on
    one host do not oversubscribe the CPU.
    """
    import datetime

    import deepspeed

    if skip_cpu_shared_memory_op():
        local_size = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", "1")))
        if "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(local_size, 1)))
    deepspeed.init_distributed(timeout=datetime.timedelta(minutes=timeout_minutes))


def barrier() -> None:
    """Wait for every rank; a no-op in a single process without torch.distributed."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
