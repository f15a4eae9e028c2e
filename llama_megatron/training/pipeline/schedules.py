"""Pipeline schedules (``pipeline.schedule``) as per-rank lists of actions, and their replay.

An action is a pass of one chunk (virtual stage, parallel/pipeline_stages.py) over one micro batch: F (forward),
BW (the whole backward), or the backward split in two (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024,
parallel/weight_grad.py): B, the gradient of the chunk's input, on the critical path (the previous stage waits for
it), and W, the weights' gradients, needed only by the optimizer step. The engine
(training/engine/pipeline_engine.py) lowers a list to receives and sends to the owners of the neighbouring virtual stages
and runs it; :func:`simulate` replays the lists of all ranks with given pass costs (a list that cannot proceed is
an error: no deadlock reaches a run), which gives each schedule's bubble and the micro batches each rank holds.

- ``1f1b`` (v = 1): DeepSpeed's engine runs it (its own instructions); the list here is its order, for the replay.
- ``zb-h1`` (v = 1): 1F1B's order with B and W; stage s keeps the W of its last s micro batches pending and runs
  the oldest after each B, so the backward wave travels at the speed of B and the W passes fill 1F1B's warm-up and
  cool-down waits: the idle share falls from (p - 1) / (m + p - 1) to (p - 1) / (3m + p - 1) at equal costs, for
  up to p micro batches held per stage (1F1B's stage 0 holds p too).
- ``interleaved-1f1b`` (v >= 2, chunks in a loop): Megatron's order. Virtual micro batch j of a rank's forward
  sequence is micro batch (j // pv) p + j % p of chunk (j // p) % v (groups of p micro batches per chunk), its
  backward sequence the same with the chunks reversed; rank r runs (p - r - 1) 2 + (v - 1) p warm-up forwards, then
  one forward and one backward, then the rest of the backwards. Idle share (p - 1) / (vm + p - 1) for v times the
  sends. Needs m to be a multiple of p (the groups), as Megatron's classic interleaving does.
- ``zb-v`` (v = 2, chunks in a V): built by list scheduling with W a little cheaper than F and B
  (:data:`_ZB_V_TICKS`): a rank that is free runs a ready B first (it releases the previous stage), else a forward
  (the later chunk first, so a micro batch leaves the rank's memory sooner) while it holds fewer than 2p chunk
  passes, else its oldest pending W. Any m >= 1.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from llama_megatron.parallel.pipeline_stages import StagePlacement


class Action(NamedTuple):
    op: str  # "F", "BW" (whole backward), "B" (input gradient), "W" (weight gradients)
    chunk: int
    micro_batch: int


def _one_f_one_b(ranks: int, rank: int, micro_batches: int, split: bool) -> list[Action]:
    """1F1B's order (ZB-H1's with ``split``: W passes of the last ``rank`` micro batches kept pending)."""
    warm_up = min(ranks - rank - 1, micro_batches)
    order = [Action("F", 0, k) for k in range(warm_up)]
    forwards, backwards, weights = warm_up, 0, 0
    while backwards < micro_batches:
        if forwards < micro_batches:
            order.append(Action("F", 0, forwards))
            forwards += 1
        order.append(Action("B" if split else "BW", 0, backwards))
        backwards += 1
        while split and backwards - weights > rank:
            order.append(Action("W", 0, weights))
            weights += 1
    return order + ([Action("W", 0, k) for k in range(weights, micro_batches)] if split else [])


def _interleaved(ranks: int, chunks: int, rank: int, micro_batches: int) -> list[Action]:
    total = micro_batches * chunks

    def virtual(j: int, backward: bool) -> tuple[int, int]:
        chunk = (j // ranks) % chunks
        return (chunks - 1 - chunk if backward else chunk), (j // (ranks * chunks)) * ranks + j % ranks

    warm_up = min((ranks - rank - 1) * 2 + (chunks - 1) * ranks, total)
    order = [Action("F", *virtual(j, False)) for j in range(warm_up)]
    for j in range(total - warm_up):
        order += [Action("F", *virtual(warm_up + j, False)), Action("BW", *virtual(j, True))]
    return order + [Action("BW", *virtual(j, True)) for j in range(total - warm_up, total)]


def _dependency(placement: StagePlacement, op: str, stage: int, micro_batch: int) -> tuple[str, int, int] | None:
    """The (op, virtual stage, micro batch) an action waits for: the previous stage's forward, the next stage's
    input gradient (the loss stage's own forward), the action's own B for a W."""
    if op == "F":
        return ("F", stage - 1, micro_batch) if stage > 0 else None
    if op == "W":
        return "B", stage, micro_batch
    return ("B", stage + 1, micro_batch) if stage < placement.stages - 1 else ("F", stage, micro_batch)


# The costs ZB-V's list is built with, in ticks: W a little cheaper than F and B, as measured on every device so far
# (the backward's attention and elementwise work is all in B). A list built for exactly equal costs is tight: each
# B arrives just as it is needed, and a B that costs a little more than F (as it does) stalls every rank behind it
# (replayed at PP4, m = 16: idle 0.105-0.113 with B 5-10% above W, against 0.040 at equal costs); this one stays
# within 0.04-0.06 over those costs and is the equal-cost list's at equal costs.
_ZB_V_TICKS = {"F": 10, "B": 10, "W": 9}


@functools.lru_cache(maxsize=64)
def _zb_v(ranks: int, micro_batches: int) -> list[list[Action]]:
    """List scheduling (module docstring), all ranks at once, on a clock of :data:`_ZB_V_TICKS`."""
    placement = StagePlacement(ranks, 2, "v")
    done: dict[tuple[str, int, int], int] = {}  # (op, stage, micro batch) -> end time
    next_k = {(r, op, c): 0 for r in range(ranks) for op in "FBW" for c in (0, 1)}
    held, orders, free_at = [0] * ranks, [[] for _ in range(ranks)], [0] * ranks

    def ready(rank: int, op: str, chunk: int, now: int) -> bool:
        k = next_k[(rank, op, chunk)]
        need = _dependency(placement, op, placement.stage(rank, chunk), k) if k < micro_batches else ("", 0, 0)
        return k < micro_batches and (need is None or done.get(need, now + 1) <= now)

    def choose(rank: int, now: int) -> tuple[str, int] | None:
        for op, chunk in (("B", 1), ("B", 0)):  # a ready B first: the previous stage waits for it
            if ready(rank, op, chunk, now):
                return op, chunk
        if held[rank] < 2 * ranks:  # then a forward, the later chunk first, within 1F1B's memory
            for op, chunk in (("F", 1), ("F", 0)):
                if ready(rank, op, chunk, now):
                    return op, chunk
        pending = [(next_k[(rank, "W", c)], c) for c in (0, 1) if ready(rank, "W", c, now)]
        return ("W", min(pending)[1]) if pending else None  # else the oldest W

    now = 0
    while sum(map(len, orders)) < 6 * ranks * micro_batches:
        for rank in range(ranks):
            choice = choose(rank, now) if free_at[rank] <= now else None
            if choice is None:
                continue
            op, chunk = choice
            k = next_k[(rank, op, chunk)]
            next_k[(rank, op, chunk)] += 1
            done[(op, placement.stage(rank, chunk), k)] = free_at[rank] = now + _ZB_V_TICKS[op]
            held[rank] += {"F": 1, "B": 0, "W": -1}[op]
            orders[rank].append(Action(op, chunk, k))
        # nothing changes before a rank is next free (every pass ends when its rank is): go there
        now = min((t for t in free_at if t > now), default=now + 1)
    return orders


def rank_actions(schedule: str, ranks: int, rank: int, micro_batches: int, chunks: int = 1) -> list[Action]:
    """``rank``'s list of actions for one training step."""
    return list(_rank_actions(schedule, ranks, rank, micro_batches, chunks))


@functools.lru_cache(maxsize=4096)
def _rank_actions(schedule: str, ranks: int, rank: int, micro_batches: int, chunks: int) -> tuple[Action, ...]:
    # kept: the memory estimate and the planner replay the same lists for many layouts (ZB-V's builds all ranks')
    return tuple(schedule_record(schedule).actions(ranks, rank, micro_batches, chunks))


def forward_actions(placement: StagePlacement, rank: int, micro_batches: int) -> list[Action]:
    """Evaluation: the forward passes of ``rank`` in (micro batch, virtual stage) order, an order every rank
    follows, so no rank waits on one that waits on it."""
    return [Action("F", chunk, k) for k in range(micro_batches)
            for chunk in sorted(range(placement.chunks), key=lambda c: placement.stage(rank, c))]


def simulate(schedule: str, ranks: int, micro_batches: int, chunks: int = 1, forward: float = 1.0,
             backward_input: float = 1.0, weight: float = 1.0) -> dict:
    """Replay every rank's list with these costs of a whole stage's passes (a chunk costs 1/v of them; a BW costs
    B + W and its gradient leaves after both), communication free and sends not blocking. Returns the time to the
    optimizer step, the idle share over all ranks, and each rank's peak of micro batches held (chunk passes whose
    forward ran and whose W did not, in whole stages: chunk passes / v)."""
    share = 1.0 / chunks
    cost = {"F": forward * share, "B": backward_input * share, "W": weight * share}
    replayed = replay(schedule, ranks, micro_batches, chunks, [cost] * (ranks * chunks))
    busy = micro_batches * (forward + backward_input + weight)
    return {"time": replayed["time"], "busy": busy, "idle_share": (replayed["time"] - busy) / replayed["time"],
            "peak_held": [h / chunks for h in replayed["peak_held"]]}


def replay(schedule: str, ranks: int, micro_batches: int, chunks: int, costs: list[dict[str, float]],
           transfer: float = 0.0) -> dict:
    """Every rank's list replayed with each virtual stage's own pass costs (``costs[stage]``: seconds of its F, B
    and W for one micro batch; a BW costs B + W) and ``transfer`` seconds for an activation or gradient to reach
    another rank (sends do not block the sender). Returns the time to the optimizer step, each rank's busy seconds
    and its peak of chunk passes held (forward run, W not yet)."""
    steps, peak = _replay_steps(schedule, ranks, micro_batches, chunks)
    took = {(stage, op): (c["B"] + c["W"] if op == "BW" else c[op]) for stage, c in enumerate(costs)
            for op in ("F", "B", "W", "BW")}
    done: dict[tuple[str, int, int], float] = {}
    clock, position, busy = [0.0] * ranks, [0] * ranks, [0.0] * ranks
    remaining = sum(map(len, steps))
    while remaining:
        progressed = False
        for r in range(ranks):
            rank_steps, at = steps[r], position[r]
            while at < len(rank_steps):
                key, need, crosses, cost_key = rank_steps[at]
                if need is not None and need not in done:
                    break
                ready = 0.0 if need is None else done[need] + (transfer if crosses else 0.0)
                cost = took[cost_key]
                clock[r] = max(clock[r], ready) + cost
                busy[r] += cost
                done[key] = clock[r]
                at += 1
            if at != position[r]:
                remaining -= at - position[r]
                position[r] = at
                progressed = True
        if not progressed:
            stuck = {r: steps[r][position[r]][0] for r in range(ranks) if position[r] < len(steps[r])}
            raise RuntimeError(f"{schedule} cannot proceed at {ranks} ranks x {chunks} chunks x {micro_batches} "
                               f"micro batches: waiting {stuck}")
    return {"time": max(clock), "busy": busy, "peak_held": list(peak)}


@functools.lru_cache(maxsize=1024)
def _replay_steps(schedule: str, ranks: int, micro_batches: int, chunks: int) -> tuple[tuple, tuple[int, ...]]:
    """Per rank, each action as (what it completes, what it waits for, whether that comes from another rank, its
    cost's key), and each rank's peak of chunk passes held: what a replay needs of the lists, worked out once."""
    placement = placement_of(schedule, ranks, chunks)
    owner = {placement.stage(r, c): r for r in range(ranks) for c in range(chunks)}
    steps, peaks = [], []
    for r in range(ranks):
        rank_steps, held, peak = [], 0, 0
        for op, chunk, k in rank_actions(schedule, ranks, r, micro_batches, chunks):
            stage = placement.stage(r, chunk)
            need = _dependency(placement, op, stage, k)
            rank_steps.append((("B" if op == "BW" else op, stage, k), need,
                               need is not None and owner[need[1]] != r, (stage, op)))
            held += {"F": 1, "B": 0, "W": -1, "BW": -1}[op]
            peak = max(peak, held)
        steps.append(tuple(rank_steps))
        peaks.append(peak)
    return tuple(steps), tuple(peaks)


def analytic_bubble(schedule: str, stages: int, micro_batches: int, chunks: int = 1) -> float:
    """The idle share of every stage with equal F, B and W costs and free communication: the record's closed form
    ((p - 1) / (m + p - 1) for 1F1B, (p - 1) / (3m + p - 1) for ZB-H1, (p - 1) / (vm + p - 1) for interleaved
    1F1B), else (ZB-V's list, built by a heuristic) its replay at these costs."""
    record = schedule_record(schedule)
    if record.idle_passes is None:
        return simulate(schedule, stages, micro_batches, chunks)["idle_share"]
    return (stages - 1) / (record.idle_passes(micro_batches, chunks) + stages - 1)


def placement_of(schedule: str, ranks: int, chunks: int = 1) -> StagePlacement:
    return StagePlacement(ranks, chunks, schedule_record(schedule).placement)


def micro_batch_rule(schedule: str, ranks: int, chunks: int, micro_batches: int) -> str | None:
    """Why ``schedule`` cannot run this many micro batches (None: it can)."""
    if micro_batches < 1:
        return "needs at least one micro batch"
    if schedule_record(schedule).micro_batches_in_groups and micro_batches % ranks:
        return (f"{schedule} runs micro batches in groups of parallel.pipeline ({ranks}): "
                f"{micro_batches} micro batches per step is not a multiple of it")
    return None


@dataclass(frozen=True)
class Schedule:
    """Everything the rest of the package knows of a pipeline schedule: the config checks its chunks and micro
    batches, the engine picks its runner and whether B and W are split, ``estimate`` replays its lists for the
    activations each rank holds (and the W work pending where the backward is split), the log line and MFU its
    bubble. A new schedule is one record here (registered in :data:`SCHEDULES`) and its tests."""

    name: str
    # the action lists of every rank: (ranks, rank, micro batches, chunks per rank) -> rank's list
    build: Callable[[int, int, int, int], list[Action]]
    placement: str = "loop"  # how a rank's chunks sit in the layer list: StagePlacement's "loop" or "v"
    chunks: tuple[int, ...] | None = (1,)  # virtual stages per rank it runs (None: any >= 2)
    split_backward: bool = False  # its backward is B + W (weight gradients queued: parallel/weight_grad.py)
    # DeepSpeed's PipelineEngine runs it with its own instructions (the list here is its order, for replays);
    # else our ActionPipelineEngine runs the lists (training/engine/pipeline_engine.py)
    deepspeed_runs_it: bool = False
    micro_batches_in_groups: bool = False  # micro batches per step a multiple of the pipeline ranks
    # busy passes per stage at equal costs, for the closed-form bubble (p - 1) / (passes + p - 1); None: replayed
    idle_passes: Callable[[int, int], int] | None = None
    needs_pipeline: bool = True  # refused at parallel.pipeline 1 (it schedules stages)

    def actions(self, ranks: int, rank: int, micro_batches: int, chunks: int = 1) -> list[Action]:
        return self.build(ranks, rank, micro_batches, chunks)

    def chunks_rule(self, virtual_stages: int) -> str | None:
        """Why this schedule cannot run ``virtual_stages`` chunks per rank (None: it can)."""
        if self.chunks is None:
            if virtual_stages < 2:
                return (f"pipeline.schedule {self.name!r} places several chunks on each rank: set "
                        f"pipeline.virtual_stages >= 2 (got {virtual_stages})")
            return None
        if virtual_stages not in self.chunks:
            return (f"pipeline.schedule {self.name!r} runs {' or '.join(map(str, self.chunks))} virtual stage(s) per "
                    f"rank, got pipeline.virtual_stages {virtual_stages}")
        return None

    def default_chunks(self) -> int:
        """The virtual stages per rank it runs by default (the benchmarks' and the tests' choice)."""
        return 2 if self.chunks is None else self.chunks[0]


SCHEDULES: dict[str, Schedule] = {record.name: record for record in (
    Schedule("1f1b", lambda p, r, m, v: _one_f_one_b(p, r, m, split=False), deepspeed_runs_it=True,
             needs_pipeline=False, idle_passes=lambda m, v: m),
    Schedule("zb-h1", lambda p, r, m, v: _one_f_one_b(p, r, m, split=True), split_backward=True,
             idle_passes=lambda m, v: 3 * m),
    Schedule("interleaved-1f1b", lambda p, r, m, v: _interleaved(p, v, r, m), chunks=None,
             micro_batches_in_groups=True, idle_passes=lambda m, v: v * m),
    Schedule("zb-v", lambda p, r, m, v: _zb_v(p, m)[r], placement="v", chunks=(2,), split_backward=True),
)}


def schedule_record(name: str) -> Schedule:
    try:
        return SCHEDULES[name]
    except KeyError:
        raise ValueError(f"unknown pipeline schedule {name!r}") from None
