"""Real multi-process runs for unit tests: ``fn(rank, world_size, *args)`` on ranks of a gloo group, no mocked
collectives. The ranks are forked from this pytest worker's rank pool (tests/rank_pool.py): fresh processes with
torch and the package already imported."""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable

import rank_pool


def run_distributed(fn: Callable, world_size: int, *args) -> None:
    """Run ``fn(rank, world_size, *args)`` (a module-level function: it is pickled by name) in ``world_size`` gloo
    processes with one thread each; fail with the first failing rank's traceback."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    result = rank_pool.run("function", pickle.dumps((fn, args)), [], world_size, env)
    if result.returncode != 0:
        raise AssertionError(f"{fn.__qualname__} on {world_size} ranks failed ({result.returncode}):\n"
                             f"{result.stderr[-6000:]}\n{result.stdout[-2000:]}")
