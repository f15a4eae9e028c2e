"""What a pipeline rank holds at its peak under a schedule: the chunk passes in flight (forward run, backward not)
and those with W pending, from replaying the rank's list of actions (training/pipeline/schedules.py). The states a
list passes through are kept per list: the memory estimate and the planner size many layouts on the same lists.
"""

from __future__ import annotations

import functools

import numpy as np

from llama_megatron.training.pipeline.schedules import rank_actions


def held_peak(schedule: str, ranks: int, rank: int, micro_batches: int, saved: list[int],
               deferred: list[int]) -> tuple[int, int, int]:
    """(bytes, chunk passes in flight, chunk passes with W pending) at the rank's peak under ``schedule``: its list
    of actions replayed, each chunk's micro batch holding ``saved[chunk]`` from its F to its backward (B or BW),
    and ``deferred[chunk]`` from its B to its W."""
    return _held_peak(schedule, ranks, rank, micro_batches, tuple(saved), tuple(deferred))


@functools.lru_cache(maxsize=16384)  # the planner sizes layouts that differ only in their states (ZeRO, offload)
def _held_peak(schedule: str, ranks: int, rank: int, micro_batches: int, saved: tuple[int, ...],
               deferred: tuple[int, ...]) -> tuple[int, int, int]:
    peak = (0, 0, 0)
    for in_flight, pending in _held_states(schedule, ranks, rank, micro_batches, len(saved)):
        held = sum(n * b for n, b in zip(in_flight, saved)) + sum(n * b for n, b in zip(pending, deferred))
        peak = max(peak, (held, sum(in_flight), sum(pending)))
    return peak


@functools.lru_cache(maxsize=4096)
def _held_states(schedule: str, ranks: int, rank: int, micro_batches: int,
                 chunks: int) -> tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]:
    """The (chunk passes in flight, chunk passes with W pending) per chunk that can be the rank's peak, whatever
    the sizes: of the states its list passes through, those no other state is at least as large as in every count
    (the planner sizes many layouts on the same lists)."""
    actions = rank_actions(schedule, ranks, rank, micro_batches, chunks)
    if not actions:
        return ()
    ops = [op for op, _, _ in actions]
    steps = np.zeros((len(actions), 2 * chunks), dtype=np.int64)  # in flight per chunk, then pending per chunk
    rows = np.arange(len(actions))
    chunk_of = np.array([chunk for _, chunk, _ in actions])
    steps[rows, chunk_of] = [{"F": 1, "B": -1, "BW": -1, "W": 0}[op] for op in ops]
    steps[rows, chunks + chunk_of] = [{"F": 0, "B": 1, "BW": 0, "W": -1}[op] for op in ops]
    counts = np.cumsum(steps, axis=0)
    # a forward next only adds to a state: the state after it is larger
    last = np.array([i + 1 == len(ops) or ops[i + 1] != "F" for i in range(len(ops))])
    states = {tuple(int(x) for x in row) for row in np.unique(counts[last], axis=0)}
    kept: list[tuple[int, ...]] = []  # largest first: a state can only be below one already kept
    for state in sorted(states, key=sum, reverse=True):
        if not any(all(x >= y for x, y in zip(other, state)) for other in kept):
            kept.append(state)
    return tuple((state[:chunks], state[chunks:]) for state in kept)
