"""Pipeline schedules (``pipeline.schedule``): DeepSpeed's 1F1B, and ZB-H1, the zero-bubble schedule of Qi et al.
("Zero Bubble Pipeline Parallelism", ICLR 2024).

ZB-H1 splits each backward pass in two (parallel/weight_grad.py): B, the gradient of the stage's input, on the
critical path (the previous stage waits for it), and W, the gradients of the weights, needed only by the optimizer
step. Stage s of p runs 1F1B's order (p - s - 1 warm-up forward passes, then one forward and one B per micro batch)
and keeps the W passes of its last s micro batches pending, running the oldest after each B and the rest before
the gradient reduction. The backward wave then travels at the speed of B instead of B + W and the W passes fill
the waits of 1F1B's warm-up and cool-down: with equal F, B and W costs the idle share per stage drops from
(p - 1) / (m + p - 1) to (p - 1) / (3m + p - 1), a third of 1F1B's for m >> p. The price: every stage holds up to
p micro batches whose W has not run (1F1B's stage 0 holds p; stage s held p - s), each keeping only what its W
needs (the linears' inputs and output gradients) after its B.

Sends in this order must not block until the receiver is ready (a stage sends while its neighbour works on
another micro batch): :class:`llama_megatron.training.engine.pipeline.ScheduledPipelineEngine` sends asynchronously.
:func:`op_order` is the order, :func:`simulate` replays it with given costs (the bubble figures and the tests).
"""

from __future__ import annotations

from collections.abc import Iterator

from deepspeed.runtime.pipe import schedule as ds_schedule


class BackwardInputPass(ds_schedule.BufferOpInstruction):
    """B: backpropagate the buffer's micro batch to the stage's input; the linears' weight-gradient work is queued
    for a later :class:`WeightPass`."""


class WeightPass(ds_schedule.PipeInstruction):
    """W: the queued weight gradients of the oldest micro batch whose B has run (micro batches in order, so each
    parameter's gradient sums them in 1F1B's order)."""


def op_order(stages: int, stage: int, micro_batches: int) -> list[tuple[str, int]]:
    """ZB-H1's order of ("F" | "B" | "W", micro batch) on ``stage``."""
    warm_up = min(stages - stage - 1, micro_batches)
    order = [("F", k) for k in range(warm_up)]
    forwards, backwards, weights = warm_up, 0, 0
    while backwards < micro_batches:
        if forwards < micro_batches:
            order.append(("F", forwards))
            forwards += 1
        order.append(("B", backwards))
        backwards += 1
        while backwards - weights > stage:  # stage s keeps s W passes pending
            order.append(("W", weights))
            weights += 1
    return order + [("W", k) for k in range(weights, micro_batches)]


class ZeroBubbleH1Schedule(ds_schedule.PipeSchedule):
    """ZB-H1 as DeepSpeed pipeline instructions (module docstring), one step per F, B or W."""

    def steps(self) -> Iterator[list[ds_schedule.PipeInstruction]]:
        first, last = self.stage_id == 0, self.stage_id == self.stages - 1
        for op, micro_batch in op_order(self.stages, self.stage_id, self.micro_batches):
            if op == "W":
                yield [WeightPass()]
                continue
            buffer = self._buffer_idx(micro_batch)
            if op == "F":
                yield [*([] if first else [ds_schedule.RecvActivation(buffer)]),
                       *([ds_schedule.LoadMicroBatch(buffer)] if first or last else []),
                       ds_schedule.ForwardPass(buffer),
                       *([] if last else [ds_schedule.SendActivation(buffer)])]
            else:
                yield [*([] if last else [ds_schedule.RecvGrad(buffer)]), BackwardInputPass(buffer),
                       *([] if first else [ds_schedule.SendGrad(buffer)])]
        yield [ds_schedule.ReduceTiedGrads(), ds_schedule.ReduceGrads(), ds_schedule.OptimizerStep()]

    def num_pipe_buffers(self) -> int:
        """Micro batches between their forward pass and their B: at most 1F1B's p - s."""
        return max(2, min(self.stages - self.stage_id, self.micro_batches))


def analytic_bubble(schedule: str, stages: int, micro_batches: int) -> float:
    """The idle share of every stage with equal F, B and W costs and free communication: (p - 1) / (m + p - 1) for
    1F1B, (p - 1) / (3m + p - 1) for ZB-H1 (what :func:`simulate` replays)."""
    passes = 3 * micro_batches if schedule == "zb-h1" else micro_batches
    return (stages - 1) / (passes + stages - 1)


def simulate(stages: int, micro_batches: int, schedule: str, forward: float = 1.0, backward_input: float = 1.0,
             weight: float = 1.0) -> dict:
    """Replay a schedule with these costs (1F1B's backward pass costs B + W and sends its gradient after both),
    communication free and sends not blocking: the time to the optimizer step, each stage's busy and idle time and the most micro batches a stage
    holds (forward run, W not run)."""
    if schedule == "1f1b":
        orders = [[("F", k) for k in range(min(stages - s - 1, micro_batches))] for s in range(stages)]
        for order in orders:
            forwards = len(order)
            for k in range(micro_batches):
                if forwards < micro_batches:
                    order.append(("F", forwards))
                    forwards += 1
                order.append(("BW", k))  # one backward pass: the gradient leaves after B and W
    else:
        orders = [op_order(stages, s, micro_batches) for s in range(stages)]
    cost = {"F": forward, "B": backward_input, "W": weight, "BW": backward_input + weight}
    done: dict[tuple[int, str, int], float] = {}
    clock, position, held, peak = [0.0] * stages, [0] * stages, [0] * stages, [0] * stages
    while any(position[s] < len(orders[s]) for s in range(stages)):
        progressed = False
        for s in range(stages):
            while position[s] < len(orders[s]):
                op, k = orders[s][position[s]]
                backward = (s + 1, op, k) if s < stages - 1 else (s, "F", k)
                needs = {"F": (s - 1, "F", k) if s > 0 else None, "B": backward, "BW": backward, "W": None}[op]
                if needs is not None and needs not in done:
                    break
                clock[s] = max(clock[s], done.get(needs, 0.0)) + cost[op]
                done[(s, op, k)] = clock[s]
                held[s] += {"F": 1, "B": 0, "W": -1, "BW": -1}[op]
                peak[s] = max(peak[s], held[s])
                position[s] += 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"{schedule} cannot proceed at {stages} stages x {micro_batches} micro batches")
    end = max(clock)
    busy = micro_batches * (forward + backward_input + weight)
    return {"time": end, "busy": busy, "idle_share": (end - busy) / end, "peak_held": peak}
