"""Where a step's time goes: torch.profiler over the steps asked, per rank, and its time by category.

``llama-megatron profile`` trains the run up to the last step asked (the same setup, layout and numbers as
``train``: profiling changes no value) and, on the ranks asked, records the steps asked with torch.profiler (CPU
and CUDA activities, shapes, Python stacks). Each such rank writes ``rank{R}.trace.json`` (Chrome / Perfetto JSON:
ui.perfetto.dev, chrome://tracing, TensorBoard's profiler plugin) and its share of ``summary.json``: the time of
the profiled steps by category, from each operator's own (self) time, so nothing counts twice:

- ``gemm``: matrix products (``mm``, ``addmm``, ``bmm``, ``baddbmm``, ``_scaled_mm``);
- ``attention``: the fused attention kernels (SDPA's, flash-attn, FlexAttention);
- ``collective:<kind>``: all-reduce, all-gather, reduce-scatter, all-to-all, broadcast, send and recv (the pipeline's
  activations; a stage waiting for its neighbour waits in recv), barrier (the kinds of
  :data:`~llama_megatron.training.diagnostics.call_graph.COLLECTIVE_KINDS`, which the call graph names too);
- ``optimizer``: the operators inside torch's ``Optimizer.step`` (the update itself);
- ``elementwise, norms, copies``: every other aten operator (and ``other operators``: the rest with a ``::`` name);
- ``data``: reading and collating the step's micro batches (all of it, Python included);
- ``host (Python, launches)``: what is left of the steps' wall time: Python between operators, DeepSpeed's and our
  bookkeeping.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from llama_megatron.errors import ConfigError
from llama_megatron.training.diagnostics.call_graph import collective_kind
from llama_megatron.training.pipeline.timeline import RANGE_PREFIX, label_instructions

DATA_RANGE = "llama_megatron: data"  # the record_function around reading a step's micro batches
MEMORY_HISTORY_ENTRIES = 200_000  # CUDA allocations kept with their stacks for the snapshot (PyTorch's default 100k)
GEMM_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_mm", "aten::addbmm",
            "aten::_grouped_mm", "aten::_scaled_grouped_mm"}
ATTENTION_PATTERN = re.compile(r"scaled_dot_product|flash_attn|flash_attention|efficient_attention|flex_attention|"
                               r"_cudnn_attention")


@dataclass(frozen=True)
class ProfileRequest:
    """The steps (first..last, 1-based, inclusive) and ranks (None: every rank) to profile, and where to write."""

    first: int
    last: int
    ranks: frozenset[int] | None
    output: str

    @classmethod
    def parse(cls, steps: str, ranks: str, output: str) -> ProfileRequest:
        match = re.fullmatch(r"\s*(\d+)\s*(?::\s*(\d+)\s*)?", steps)
        if not match:
            raise ConfigError(f"--steps {steps!r}: give a step (3) or a range of steps (3:5), counted from 1")
        first = int(match.group(1))
        last = int(match.group(2) or first)
        if first < 1 or last < first:
            raise ConfigError(f"--steps {steps}: the first step must be >= 1 and <= the last")
        chosen = None
        if ranks.strip() != "all":
            try:
                chosen = frozenset(int(r) for r in ranks.split(","))
            except ValueError:
                raise ConfigError(f"--ranks {ranks!r}: 'all' or global ranks separated by commas (0,3)") from None
        return cls(first, last, chosen, output)

    def check(self, train_steps: int, world_size: int) -> None:
        """One line (exit 2) for steps outside the run or ranks outside the world."""
        if self.last >= train_steps:  # the call graph takes the step after the last one asked
            raise ConfigError(f"--steps {self.first}:{self.last} lies outside the run: train.steps is {train_steps}, "
                              f"and the call graph takes the step after the last asked (ask up to step "
                              f"{train_steps - 1})")
        outside = sorted(r for r in self.ranks or () if not 0 <= r < world_size)
        if outside:
            raise ConfigError(f"--ranks {','.join(map(str, outside))} outside the world of {world_size} processes "
                              f"(ranks 0-{world_size - 1})")

    def profiles(self, rank: int) -> bool:
        return self.ranks is None or rank in self.ranks


def is_operator(name: str) -> bool:
    """Whether a profiler event is an operator (aten, c10d, a collective's range), not a Python function's."""
    return "::" in name or name.lower().startswith(("gloo:", "nccl:", "record_param_comms"))


def category(name: str, ancestors: tuple[str, ...]) -> str:
    """The summary's category of the operator ``name`` under the ranges ``ancestors`` (innermost first)."""
    lowered = name.lower()
    if name in GEMM_OPS:
        return "gemm"
    if ATTENTION_PATTERN.search(lowered):
        return "attention"
    if lowered.startswith(("c10d::", "gloo:", "nccl:", "record_param_comms")):
        return f"collective:{collective_kind(name) or 'other'}"
    if any(outer.startswith("Optimizer.step#") for outer in ancestors):
        return "optimizer"
    return "elementwise, norms, copies" if lowered.startswith("aten::") else "other operators"


def time_by_category(events, wall_seconds: float) -> dict[str, float]:
    """Seconds per category of the profiled steps (``wall_seconds`` long) from torch.profiler's ``events``: each
    operator's self time, ``data`` the whole time spent reading batches, and ``host (Python, launches)`` what is
    left of the wall time (Python between operators, the launcher's and DeepSpeed's bookkeeping). CUDA kernels'
    device time is under ``device:<category>`` of the operator that launched them."""
    out: dict[str, float] = {}

    def add(kind: str, seconds: float) -> None:
        out[kind] = out.get(kind, 0.0) + seconds

    for event in events:
        if event.name == DATA_RANGE:
            add("data", event.cpu_time_total / 1e6)
            continue
        if not is_operator(event.name):
            continue
        ancestors, parent = [], event.cpu_parent
        while parent is not None:
            ancestors.append(parent.name)
            parent = parent.cpu_parent
        if DATA_RANGE in ancestors:
            continue
        kind = category(event.name, tuple(ancestors))
        add(kind, event.self_cpu_time_total / 1e6)
        device = getattr(event, "self_device_time_total", 0)
        if device:
            add(f"device:{kind}", device / 1e6)
    host = sum(seconds for kind, seconds in out.items() if not kind.startswith("device:"))
    out["host (Python, launches)"] = max(0.0, wall_seconds - host)
    return dict(sorted(out.items(), key=lambda item: -item[1]))


class StepProfiler:
    """torch.profiler over the steps ``request`` names, on this rank if it is asked for; then the call graph
    (:class:`~llama_megatron.training.diagnostics.call_graph.CallGraphRecorder`) over the step after them."""

    def __init__(self, request: ProfileRequest, rank: int) -> None:
        self.request, self.rank = request, rank
        self.active = request.profiles(rank)
        self._profiler: torch.profiler.profile | None = None
        self.seconds: dict[int, float] = {}
        self.groups: dict[int, str] = {}
        self.peers: frozenset[int] = frozenset()
        self.pipeline_rank = 0
        self.precision = "fp32"
        self.call_graph = None

    def attach(self, pctx, precision: str, pipeline_engine=None) -> None:
        """The run's process groups, by which the call graph names each collective's (TP, CP, EP, DP, PP), its
        precision (the activations' bytes, for the collectives' formula) and, under PP, its pipeline engine, whose
        instructions then run in ranges the trace shows (``pipeline: ForwardPass mb 3``)."""
        from llama_megatron.training.diagnostics.call_graph import group_names, pipeline_peers

        self.groups, self.peers = group_names(pctx), pipeline_peers(pctx)
        self.pipeline_rank, self.precision = pctx.pp_rank, precision
        if pipeline_engine is not None and self.active:
            label_instructions(pipeline_engine)

    @property
    def call_graph_step(self) -> int:
        return self.request.last + 1

    def done(self, step: int) -> bool:
        """Whether the run may stop after ``step``: every rank's answer is the same (the call graph's step is past)."""
        return step >= self.call_graph_step

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Around everything step ``step`` does (reading its batches included)."""
        if self.active and step == self.call_graph_step:
            from llama_megatron.training.diagnostics.call_graph import CallGraphRecorder

            self.call_graph = CallGraphRecorder(self.groups, self.peers)
            with self.call_graph:
                yield
            return
        if not self.active or not self.request.first <= step <= self.request.last:
            yield
            return
        if self._profiler is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._profiler = torch.profiler.profile(activities=activities, record_shapes=True, with_stack=True,
                                                    profile_memory=True)
            if torch.cuda.is_available():  # every allocation with its stack: PyTorch's memory viz reads the dump
                torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES)
            self._profiler.__enter__()
        start = time.perf_counter()
        yield
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.seconds[step] = time.perf_counter() - start
        if step == self.request.last:  # stopped here: the call graph's step and the run's end stay out of it
            self._profiler.__exit__(None, None, None)
            if torch.cuda.is_available():
                os.makedirs(self.request.output, exist_ok=True)
                torch.cuda.memory._dump_snapshot(os.path.join(self.request.output, f"rank{self.rank}.memory.pickle"))
                torch.cuda.memory._record_memory_history(enabled=None)

    def data(self) -> contextlib.AbstractContextManager:
        """Around reading one step's micro batches: ``data`` in the summary."""
        return torch.profiler.record_function(DATA_RANGE) if self._profiler is not None else contextlib.nullcontext()

    def finish(self) -> dict | None:
        """Stop, write this rank's trace; this rank's summary (None where nothing was profiled)."""
        if self._profiler is None:
            return None
        os.makedirs(self.request.output, exist_ok=True)
        trace = os.path.join(self.request.output, f"rank{self.rank}.trace.json")
        self._profiler.export_chrome_trace(trace)
        times = time_by_category(self._profiler.events(), sum(self.seconds.values()))
        memory = memory_timeline(trace)
        pipeline = pipeline_time(pipeline_ranges(trace), self.request.last - self.request.first + 1)
        with open(os.path.join(self.request.output, f"rank{self.rank}.memory.json"), "w", encoding="utf-8") as fh:
            json.dump(memory, fh)
        out = {"rank": self.rank, "pipeline_rank": self.pipeline_rank, "trace": os.path.basename(trace),
               "steps": list(range(self.request.first, self.request.last + 1)),
               "step_seconds": {str(s): self.seconds[s] for s in sorted(self.seconds)},
               "seconds_by_category": times,
               **({"pipeline": pipeline} if pipeline else {}),
               "memory": {"timeline": f"rank{self.rank}.memory.json", "peak_bytes": memory["peak_bytes"],
                          "device": memory["device"],
                          **({"snapshot": f"rank{self.rank}.memory.pickle"} if torch.cuda.is_available() else {})}}
        if self.call_graph is not None:
            out["call_graph"] = self._write_call_graph()
        return out

    def _write_call_graph(self) -> dict:
        """``rank{R}.callgraph.dot`` (and ``.svg`` where a Graphviz program is installed); what it counted."""
        from llama_megatron.training.diagnostics.call_graph import render_svg, to_dot

        stem = os.path.join(self.request.output, f"rank{self.rank}.callgraph")
        graph = to_dot(list(self.call_graph.rows.values()), f"rank {self.rank}, step {self.call_graph_step}")
        with open(stem + ".dot", "w", encoding="utf-8") as fh:
            fh.write(graph.source)
        drawn = render_svg(stem + ".dot", stem + ".svg")
        return {"step": self.call_graph_step, "dot": os.path.basename(stem) + ".dot",
                "svg": os.path.basename(stem) + ".svg" if drawn else None, **self.call_graph.summary()}


def write_summary(output: str, ranks: list[dict], extra: dict) -> str:
    """``summary.json`` (atomically) from every profiled rank's summary; its path."""
    path = os.path.join(output, "summary.json")
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump({**extra, "ranks": sorted(ranks, key=lambda r: r["rank"])}, fh, indent=2)
        fh.write("\n")
    os.replace(tmp, path)
    return path


# instruction name -> the pass it is (ours and DeepSpeed's); the rest are communication or bookkeeping
PASS_OF = {"ForwardPass": "F", "ChunkForward": "F", "BackwardPass": "B", "ChunkBackward": "B",
           "ChunkBackwardInput": "B", "ChunkWeight": "W"}


def pipeline_ranges(trace_path: str) -> list[tuple[str, str, float, float]]:
    """(pass F/B/W or ``comm`` or ``other``, the range's name, start, end) in ms on the trace's clock, in order."""
    with open(trace_path, encoding="utf-8") as fh:
        events = json.load(fh)["traceEvents"]
    out = []
    for e in events:
        name = e.get("name", "")
        if e.get("ph") != "X" or not name.startswith(RANGE_PREFIX):
            continue
        instruction = name[len(RANGE_PREFIX):].split(" ")[0]
        kind = PASS_OF.get(instruction, "comm" if instruction.startswith(("Send", "Recv")) else "other")
        out.append((kind, name[len(RANGE_PREFIX):], e["ts"] / 1e3, (e["ts"] + e["dur"]) / 1e3))
    return sorted(out, key=lambda r: r[2])


def busy_share(ranges: list[tuple[str, str, float, float]], start: float, end: float) -> float:
    """The share of [start, end] a rank spends in F, B and W passes."""
    busy = sum(min(e, end) - max(s, start) for kind, _, s, e in ranges if kind in "FBW" and e > start and s < end)
    return busy / (end - start) if end > start else 0.0


def pipeline_time(ranges: list[tuple[str, str, float, float]], steps: int) -> dict:
    """A pipeline rank's time over the profiled steps, from its instruction ranges: the span of each step's
    schedule (first instruction to last; ranges of one step lie closer together than the optimizer step between
    steps), the F/B/W passes in it, the sends and receives (a rank waiting for its neighbour waits in a receive), and
    the idle share (the span not spent in passes)."""
    if not ranges:
        return {}
    gaps = sorted(range(1, len(ranges)), key=lambda i: ranges[i][2] - ranges[i - 1][3], reverse=True)
    cuts = sorted(gaps[:steps - 1])  # the widest gaps separate the steps
    bounds = [0, *cuts, len(ranges)]
    span = sum(ranges[b - 1][3] - ranges[a][2] for a, b in zip(bounds, bounds[1:]))
    passes = sum(e - s for kind, _, s, e in ranges if kind in "FBW") / 1e3
    comm = sum(e - s for kind, _, s, e in ranges if kind == "comm") / 1e3
    return {"span_s": span / 1e3, "passes_s": passes, "send_recv_s": comm,
            "idle_share": 1 - passes / (span / 1e3) if span else 0.0}


def memory_timeline(trace_path: str, points: int = 2000) -> dict:
    """The bytes allocated over the profiled steps, from the trace's ``[memory]`` events (torch.profiler's
    ``profile_memory``: every allocation and free of the device's allocator, or of the CPU's): ``points`` [ms from
    the first event, bytes] at most (the timeline thinned evenly, its peak kept) and the peak. On a GPU the bytes are
    the allocator's whole total; on a CPU those allocated since the profiler started (what the steps add on top of
    the model states held before them)."""
    with open(trace_path, encoding="utf-8") as fh:
        events = [e for e in json.load(fh)["traceEvents"] if e.get("name") == "[memory]"]
    gpu = [e for e in events if e["args"].get("Device Type") == 1]
    events = sorted(gpu or [e for e in events if e["args"].get("Device Type") == 0], key=lambda e: e["ts"])
    if not events:
        return {"device": "cuda" if gpu else "cpu", "peak_bytes": 0, "points": []}
    start = events[0]["ts"]
    series = [[(e["ts"] - start) / 1e3, int(e["args"]["Total Allocated"])] for e in events]
    peak = max(range(len(series)), key=lambda i: series[i][1])
    stride = max(1, len(series) // points)
    kept = sorted({*range(0, len(series), stride), peak, len(series) - 1})
    return {"device": "cuda" if gpu else "cpu", "peak_bytes": series[peak][1], "points": [series[i] for i in kept]}


def bytes_against_formula(counted: dict[str, dict], formula: dict[str, float]) -> dict[str, dict]:
    """Per ``"<kind> <group>"`` the bytes the call graph counted beside the layout's formula
    (:func:`~llama_megatron.training.diagnostics.collective_traffic.rank_step_bytes`), for every collective the
    formula names and every counted one of a group it names (the formula leaves the loss's and the optimizer's
    few-byte collectives and the gradients' reduction out: those show with ``formula`` None)."""
    groups = {key.rpartition(" ")[2] for key in formula}
    keys = sorted(set(formula) | {k for k in counted if k.rpartition(" ")[2] in groups})
    return {key: {"counted": counted.get(key, {}).get("bytes", 0), "formula": formula.get(key)} for key in keys}


def summary_table(ranks: list[dict]) -> str:
    """The categories' seconds per profiled rank (and their share of the rank's total), as printed at the end; then
    each collective's bytes in the call graph's step beside the formula's."""
    kinds: list[str] = []
    for rank in ranks:
        kinds += [k for k in rank["seconds_by_category"] if k not in kinds]
    head = f"{'category':<28}" + "".join(f"{'rank ' + str(r['rank']):>18}" for r in ranks)
    lines = [head]
    for kind in kinds:
        cells = []
        for rank in ranks:
            total = sum(rank["seconds_by_category"].values()) or 1.0
            seconds = rank["seconds_by_category"].get(kind, 0.0)
            cells.append(f"{seconds:>10.3f} s {100 * seconds / total:>4.0f}%")
        lines.append(f"{kind:<28}" + "".join(f"{c:>18}" for c in cells))
    if any("pipeline" in r for r in ranks):  # the schedule's span: its passes, sends/receives, idle share
        lines += ["", f"{'pipeline (schedule span)':<28}{'rank':>6}{'passes':>12}{'send/recv':>12}{'idle':>8}"]
        for r in ranks:
            if "pipeline" in r:
                p = r["pipeline"]
                lines.append(f"{'':<28}{r['rank']:>6}{p['passes_s']:>10.3f} s{p['send_recv_s']:>10.3f} s"
                             f"{100 * p['idle_share']:>7.0f}%")
    lines += ["", f"{'memory (profiled steps)':<28}{'rank':>6}{'peak':>16}{'estimate':>16}"]
    for r in ranks:
        memory = r["memory"]
        guess = memory.get("estimate", {})
        # a GPU's peak is the allocator's total; a CPU's what the steps allocated on top of the states held before
        guess = guess.get("total" if memory["device"] == "cuda" else "gradients, activations and logits")
        lines.append(f"{memory['device'] + ' allocated':<28}{r['rank']:>6}{memory['peak_bytes']:>16,}"
                     f"{'-' if guess is None else format(guess, ','):>16}")
    compared = [(r["rank"], r["call_graph"].get("bytes_vs_formula", {})) for r in ranks if "call_graph" in r]
    if any(table for _, table in compared):
        lines += ["", f"{'collectives (call graph step)':<28}{'rank':>6}{'bytes':>16}{'formula':>16}{'ms':>10}"]
        for rank, table in compared:
            seconds = next(r for r in ranks if r["rank"] == rank)["call_graph"]["collectives"]
            for key, pair in table.items():
                formula = "-" if pair["formula"] is None else f"{pair['formula']:,.0f}"
                ms = 1e3 * seconds.get(key, {}).get("seconds", 0.0)
                lines.append(f"{key:<28}{rank:>6}{pair['counted']:>16,}{formula:>16}{ms:>10.2f}")
    return "\n".join(lines)
