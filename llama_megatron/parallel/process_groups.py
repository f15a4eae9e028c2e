"""The process groups of a command: started through DeepSpeed (gloo on CPU, NCCL on GPU) with rank 0 serving the
rendezvous (parallel/job_store.py), waited on, and taken down in order at the end."""

from __future__ import annotations

import os

import torch

from llama_megatron.parallel.job_store import port_in_use, rendezvous_address, settle_job_store
from llama_megatron.parallel.placement import available_cores, placement
from llama_megatron.quiet import quiet_library_warnings


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


def init_distributed(timeout_minutes: float = 30) -> None:
    """Initialise DeepSpeed's communication layer (gloo on CPU, NCCL on GPU: DeepSpeed picks).

    On CPU DeepSpeed would JIT-build its shared-memory all-reduce op (1-2 minutes) that only inference uses;
    mark it incompatible first. ``OMP_NUM_THREADS`` defaults to cores / local processes so several ranks on
    one host do not oversubscribe the CPU.
    """
    import datetime

    import deepspeed

    quiet_library_warnings()
    where = placement()
    if skip_cpu_shared_memory_op() and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, available_cores() // max(where.local_world_size, 1)))
    address = rendezvous_address()
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torchrun's agent serves it
    server = None
    import torch.distributed as dist

    started = dist.is_available() and dist.is_initialized()  # a later run in the same processes (tests)
    if where.world_size > 1 and address is not None and not agent_store and not started:
        server = settle_job_store(address, where, 60.0 * timeout_minutes)
    if server is None:
        try:
            deepspeed.init_distributed(timeout=datetime.timedelta(minutes=timeout_minutes))
        except RuntimeError as exc:  # torch serving the store itself (a wildcard MASTER_ADDR) on a taken port
            if where.rank == 0 and address is not None and "EADDRINUSE" in str(exc):
                raise port_in_use(address) from None
            raise
        return
    # rank 0 serves the store itself, bound to MASTER_ADDR: torch's env:// rendezvous then connects to it as a
    # client, as it does to torchrun's agent store (the variable says so only for this call)
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    try:
        deepspeed.init_distributed(timeout=datetime.timedelta(minutes=timeout_minutes))
    finally:
        del os.environ["TORCHELASTIC_USE_AGENT_STORE"]


def barrier() -> None:
    """Wait for every rank; a no-op in a single process without torch.distributed."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def end_process_groups() -> None:
    """After a command's last collective: wait for every rank, then take the process groups down in order. Left
    to the interpreter's exit, a rank whose peer had already gone could abort in gloo's teardown ("terminate called
    without an active exception", exit -6: seen once at the end of a 2-rank `generate`)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
