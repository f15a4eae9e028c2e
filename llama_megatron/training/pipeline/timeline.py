"""What a pipeline schedule did, measured: the start and end of every instruction a pipeline engine runs, and the
activation bytes its stage holds after each (``benchmarks/parallel_overhead.py --schedules``).

:class:`InstructionTimeline` times an engine's instructions through the engine's own instruction map (an
attribute of this one engine, DeepSpeed's and ours alike; nothing module-wide is replaced). :func:`bubble` turns
the records of all stages into each stage's busy and idle time over the pipeline's span: busy is the compute of
its forward and backward passes (B and W for split schedules), idle everything else between the first instruction
of any stage and the last pass of any stage (waiting on a receive or a blocking send, and communication).

:class:`ActivationMeter` counts the bytes autograd saves for backward (each storage once, parameters excluded),
plus the tensors a :class:`~llama_megatron.parallel.weight_grad.WeightGradStore` keeps for W passes not yet run:
what a stage holds for the micro batches in flight.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import MethodType

import torch
from deepspeed.runtime.pipe import schedule as ds_schedule
from torch import nn

from llama_megatron.parallel.weight_grad import WeightGradStore
from llama_megatron.training.pipeline import instructions

# compute instructions (DeepSpeed's 1F1B and our engine's): a stage is busy while it runs one
PASSES = (ds_schedule.ForwardPass, ds_schedule.BackwardPass, *instructions.PASSES)


def _storage_key(tensor: torch.Tensor) -> tuple[str, int]:
    return str(tensor.device), tensor.untyped_storage().data_ptr()


def pipeline_buffers(engine) -> list[torch.Tensor]:
    """The tensors a DeepSpeed pipeline engine (ours too) keeps for micro batches in flight: its input and output
    buffers, and ours' hand-overs between a rank's chunks, received gradients not yet used, sends not yet complete
    and receives posted ahead."""
    entries = [*engine.pipe_buffers.get("inputs", ()), *engine.pipe_buffers.get("outputs", ()),
               *getattr(engine, "_local", {}).values(), *getattr(engine, "_grads", {}).values(),
               *(engine.in_transit() if hasattr(engine, "in_transit") else ())]
    found = []
    for entry in entries:
        for item in entry if isinstance(entry, (tuple, list)) else (entry,):
            found += [t for t in (item if isinstance(item, (tuple, list)) else (item,)) if torch.is_tensor(t)]
    return found


class ActivationMeter:
    """Bytes of the tensors saved for backward that are alive now (each storage once), parameters excluded, plus
    a weight-gradient store's pending tensors and the tensors ``held`` returns (a pipeline engine's buffers of the
    micro batches in flight: received inputs and outputs to send, which autograd need not save); the peak over
    :meth:`sample` calls."""

    def __init__(self, model: nn.Module, store: WeightGradStore | None = None,
                 held: Callable[[], list[torch.Tensor]] | None = None) -> None:
        self._parameters = {_storage_key(p) for p in model.parameters()}
        self._live: dict[tuple[str, int], list[int]] = {}  # storage -> [bytes, references]
        self.store, self.held, self.peak = store, held, 0

    def _pack(self, tensor: torch.Tensor) -> object:
        key = _storage_key(tensor)
        if key in self._parameters:
            return tensor
        entry = self._live.setdefault(key, [tensor.untyped_storage().nbytes(), 0])
        entry[1] += 1
        return _Saved(tensor, key, self)

    def _release(self, key: tuple[str, int]) -> None:
        entry = self._live[key]
        entry[1] -= 1
        if entry[1] == 0:
            del self._live[key]

    @contextmanager
    def recording(self) -> Iterator[None]:
        """Count what the forward passes run inside save for backward."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack):
            yield

    def current(self) -> int:
        held = {key: entry[0] for key, entry in self._live.items()}
        for tensor in self.store.pending_tensors() if self.store is not None else ():
            held.setdefault(_storage_key(tensor), tensor.untyped_storage().nbytes())
        for tensor in self.held() if self.held is not None else ():
            if _storage_key(tensor) not in self._parameters:
                held.setdefault(_storage_key(tensor), tensor.untyped_storage().nbytes())
        return sum(held.values())

    def sample(self) -> int:
        now = self.current()
        self.peak = max(self.peak, now)
        return now


class _Saved:
    """A saved tensor as autograd keeps it packed; its release (the graph freed) ends its count."""

    __slots__ = ("tensor", "key", "meter")

    def __init__(self, tensor: torch.Tensor, key: tuple[str, int], meter: ActivationMeter) -> None:
        self.tensor, self.key, self.meter = tensor, key, meter

    def __del__(self) -> None:
        self.meter._release(self.key)


def _unpack(packed: object) -> torch.Tensor:
    return packed.tensor if isinstance(packed, _Saved) else packed


class InstructionTimeline:
    """Records (instruction, micro-batch buffer or None, start, end, activation bytes after) for every instruction
    ``engine`` runs, on a clock shared by the processes of one machine (``time.monotonic``)."""

    def __init__(self, engine, meter: ActivationMeter | None = None) -> None:
        self.records: list[tuple[str, int | None, float, float, int | None]] = []
        self.meter = meter
        engine._INSTRUCTION_MAP = {kind: self._timed(kind.__name__, run)
                                   for kind, run in type(engine)._INSTRUCTION_MAP.items()}

    def _timed(self, name: str, run: Callable) -> Callable:
        def timed(engine, **kwargs) -> None:
            start = time.monotonic()
            MethodType(run, engine)(**kwargs)
            end = time.monotonic()
            held = self.meter.sample() if self.meter is not None else None
            self.metering += time.monotonic() - end
            self.records.append((name, kwargs.get("buffer_id"), start, end, held))
        return timed

    metering = 0.0  # seconds spent sampling the meter since the last clear: the measurement's, not the schedule's

    def clear(self) -> None:
        self.records.clear()
        self.metering = 0.0
        if self.meter is not None:
            self.meter.peak = 0


RANGE_PREFIX = "pipeline: "  # the torch.profiler ranges of label_instructions: "pipeline: ForwardPass mb 3"


def label_instructions(engine) -> None:
    """Run each instruction ``engine`` runs inside a torch.profiler range named for it and its micro batch
    (``pipeline: ForwardPass mb 3``; ``BackwardInputPass``, ``WeightPass``, sends and receives alike), so that a trace
    shows every stage's F, B and W passes (``llama-megatron plot --profile``). Through the engine's own instruction
    map, as :class:`InstructionTimeline`; outside a profiler a range costs a few microseconds."""
    def labelled(name: str, run: Callable) -> Callable:
        def run_in_range(engine, **kwargs) -> None:
            micro_batch = kwargs.get("micro_batch", kwargs.get("buffer_id"))  # DeepSpeed's: its buffer
            label = (f"{RANGE_PREFIX}{name}" + ("" if micro_batch is None else f" mb {micro_batch}")
                     + ("" if kwargs.get("chunk") is None else f" chunk {kwargs['chunk']}"))
            with torch.profiler.record_function(label):
                MethodType(run, engine)(**kwargs)
        return run_in_range

    engine._INSTRUCTION_MAP = {kind: labelled(kind.__name__, run)
                               for kind, run in engine._INSTRUCTION_MAP.items()}


def bubble(stage_records: list[list[tuple]]) -> dict:
    """Busy and idle seconds per stage over the span from the first instruction of any stage to the end of the
    last forward/backward pass of any stage (the optimizer step and gradient reduction after it left out)."""
    names = {kind.__name__ for kind in PASSES}
    passes = [[r for r in records if r[0] in names] for records in stage_records]
    start = min(records[0][2] for records in stage_records if records)
    end = max(r[3] for records in passes for r in records)
    span = end - start
    busy = [sum(r[3] - r[2] for r in records) for records in passes]
    idle = [span - b for b in busy]
    return {"span_s": span, "busy_s": busy, "idle_s": idle, "idle_share": sum(idle) / (span * len(busy)),
            "pass_s": {name: _mean([r[3] - r[2] for records in passes for r in records if r[0] == name])
                       for name in sorted(names) if any(r[0] == name for records in passes for r in records)}}


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)
