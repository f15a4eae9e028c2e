"""Real multi-process runs for unit tests: torch.multiprocessing spawn + gloo, no mocked collectives."""

from __future__ import annotations

import gc
import os
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from llama_megatron.parallel.placement import free_port


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, errors) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    except BaseException:
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")
        raise
    finally:
        dist.destroy_process_group()
    gc.freeze()  # the worker ends here: its exit skips a collection of everything imported (llama_megatron/process_exit.py)


def run_distributed(fn: Callable, world_size: int, *args) -> None:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` gloo processes; re-raise the first failure."""
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    try:
        mp.start_processes(_worker, args=(world_size, free_port(), fn, args, errors), nprocs=world_size,
                           join=True, start_method="spawn")
    except Exception as exc:
        message = errors.get() if not errors.empty() else str(exc)
        raise AssertionError(message) from None
