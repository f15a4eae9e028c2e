"""Which module issued which operator, with its FLOPs, time and (for a collective) bytes and process group.

A :class:`CallGraphRecorder` is a ``TorchDispatchMode``: every aten and c10d operator of the step it is active in
passes through it. Each is attributed to the innermost module running it (torch's ``ModuleTracker``: forward, and
backward through the autograd hooks it sets), to the Python frame of ours that issued it (``file:line
function``; backward operators run in autograd's engine, below no frame of ours), and counted: calls, FLOPs by
``torch.utils.flop_counter``'s formulas (the same ``FlopCounterMode`` counts, checked against ours in
``tests/test_training_mfu.py``), host wall time, and for a collective its kind, the bytes of its tensors and its
process group by name (TP, CP, DP, DP x CP, EP, EDP, PP, or the world). :func:`to_dot` draws module -> operator
edges weighted by calls, FLOPs and time, collectives apart, with the ``graphviz`` package (its DOT source);
:func:`render_svg` runs Graphviz's ``dot`` (or ``graphviz-pure``, its port on PyPI) on it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry
from torch.utils.module_tracker import ModuleTracker

PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COLLECTIVE_KINDS = (  # (kind, what a name holds for it), first match wins: c10d's operators ("c10d::alltoall_base_")
    # and the profiler's ranges of gloo / NCCL ("gloo:all_to_all") name a collective alike; read by the call graph and
    # by the profile's time categories
    ("all_to_all", ("alltoall", "all_to_all")),
    ("reduce_scatter", ("reduce_scatter", "reducescatter")),
    ("all_gather", ("allgather", "all_gather")),
    ("all_reduce", ("allreduce", "all_reduce")),
    ("broadcast", ("broadcast",)),
    ("send", ("send",)),
    ("recv", ("recv",)),
    ("barrier", ("barrier",)),
    ("reduce", ("reduce",)),
    ("gather", ("gather",)),
    ("scatter", ("scatter",)),
)


def collective_kind(name: str) -> str | None:
    """The kind of the collective a c10d operator or a profiler range is named for, or None."""
    lowered = name.lower()
    for kind, needles in COLLECTIVE_KINDS:
        if any(needle in lowered for needle in needles):
            return kind
    return None


# a group serving several roles (EP 1's expert-data group is the data group) takes its first name here
GROUP_NAMES = (("tp_group", "TP"), ("cp_group", "CP"), ("dp_group", "DP"), ("dp_cp_group", "DP x CP"),
               ("pp_group", "PP"), ("ep_group", "EP"), ("edp_group", "EDP"))


@dataclass
class OperatorCalls:
    """One (module, operator, frame, pass, group) row: what its calls add up to."""

    module: str
    operator: str
    frame: str
    backward: bool
    collective: str | None = None
    group: str | None = None
    calls: int = 0
    flops: int = 0
    seconds: float = 0.0
    bytes: int = 0
    shapes: set = field(default_factory=set)


def pipeline_peers(pctx: Any) -> frozenset[int]:
    """The global ranks of this rank's pipeline group (its stages' point-to-point peers)."""
    import torch.distributed as dist

    if getattr(pctx, "pp_size", 1) <= 1 or pctx.pp_group is None:
        return frozenset()
    return frozenset(dist.get_process_group_ranks(pctx.pp_group))


def group_names(pctx: Any) -> dict[int, str]:
    """id(process group) -> its name in the layout (the first name of a group serving several roles)."""
    out: dict[int, str] = {}
    for attribute, name in GROUP_NAMES:
        group = getattr(pctx, attribute, None)
        if group is not None and id(group) not in out:
            out[id(group)] = name
    return out


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _our_frame(backward: bool) -> str:
    """The innermost frame in this package outside this module: ``path:line function``."""
    for frame in reversed(traceback.extract_stack(limit=40)):
        if frame.filename.startswith(PACKAGE_DIR) and not frame.filename.endswith("call_graph.py"):
            return f"{os.path.relpath(frame.filename, os.path.dirname(PACKAGE_DIR))}:{frame.lineno} {frame.name}"
    return "(autograd)" if backward else "(outside the package)"


class CallGraphRecorder(TorchDispatchMode):
    """Records every operator dispatched while active (one step: frames are read per call)."""

    def __init__(self, groups: dict[int, str] | None = None, pipeline_peers: frozenset[int] = frozenset()) -> None:
        super().__init__()
        self.groups = groups or {}
        self.pipeline_peers = pipeline_peers  # send/recv over the world with one of these is the pipeline's
        self.tracker = ModuleTracker()
        self.rows: dict[tuple, OperatorCalls] = {}

    def __enter__(self):
        self.tracker.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        self.tracker.__exit__(*exc)

    def _group(self, args) -> str | None:
        for arg in args:
            if isinstance(arg, torch.ScriptObject):
                try:
                    group = torch._C._distributed_c10d.ProcessGroup.unbox(arg)
                except (AttributeError, RuntimeError):
                    continue
                if id(group) in self.groups:
                    return self.groups[id(group)]
                import torch.distributed as dist

                if group is dist.group.WORLD or group == dist.distributed_c10d._get_default_group():
                    return "world"
                return "ranks " + ",".join(map(str, dist.get_process_group_ranks(group)))
        return None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        start = time.perf_counter()
        out = func(*args, **kwargs)
        seconds = time.perf_counter() - start
        packet = func._overloadpacket
        namespace, _, name = str(packet).partition(".")
        collective = collective_kind(name) if namespace == "c10d" else None
        flops = int(flop_registry[packet](*args, **kwargs, out_val=out)) if packet in flop_registry else 0
        module = max(self.tracker.parents, key=len)
        backward = self.tracker.is_bw
        group = self._group(args) if collective else None
        if collective in ("send", "recv") and group == "world" and args[2] in self.pipeline_peers:
            group = "PP"
        key = (module, str(packet), _our_frame(backward), backward, group)
        row = self.rows.get(key)
        if row is None:
            row = self.rows[key] = OperatorCalls(module, str(packet), key[2], backward, collective, group)
        row.calls += 1
        row.flops += flops
        row.seconds += seconds
        if collective:  # the whole tensor: a reduce-scatter's input, every other collective's first argument
            payload = args[1] if collective == "reduce_scatter" else args[0]
            row.bytes += sum(t.numel() * t.element_size() for t in _tensors(payload))
        elif flops:
            row.shapes.add(tuple(tuple(t.shape) for t in _tensors(args)[:2]))
        return out

    def total_flops(self) -> int:
        return sum(row.flops for row in self.rows.values())

    def summary(self) -> dict:
        """Per module: FLOPs and seconds of its own operators; per collective kind and group: calls and bytes."""
        modules: dict[str, dict] = {}
        collectives: dict[str, dict] = {}
        for row in self.rows.values():
            entry = modules.setdefault(row.module, {"flops": 0, "seconds": 0.0, "calls": 0})
            entry["flops"] += row.flops
            entry["seconds"] += row.seconds
            entry["calls"] += row.calls
            if row.collective:  # per group, the bytes of the collectives this module issued
                by_group = entry.setdefault("collective_bytes", {})
                by_group[row.group] = by_group.get(row.group, 0) + row.bytes
                c = collectives.setdefault(f"{row.collective} {row.group}", {"calls": 0, "bytes": 0, "seconds": 0.0})
                c["calls"] += row.calls
                c["bytes"] += row.bytes
                c["seconds"] += row.seconds
        return {"flops": self.total_flops(), "modules": modules, "collectives": collectives}


def _short(module: str) -> str:
    return module.partition(".")[2] or module  # the root module's class name dropped


def to_dot(rows: list[OperatorCalls], title: str):
    """A ``graphviz.Digraph``: module nodes, an operator node per (module, operator) with FLOPs (those with FLOPs
    or a collective; the rest summed into one ``other ops`` node per module), edges labelled with calls, FLOPs and
    milliseconds; collectives as red boxes with their bytes and group."""
    import graphviz

    graph = graphviz.Digraph(name="callgraph", graph_attr={"rankdir": "LR", "label": title, "fontsize": "12"},
                             node_attr={"fontsize": "10"})
    merged: dict[tuple, OperatorCalls] = {}
    for row in rows:
        shown = row.flops or row.collective
        key = (row.module, row.operator if shown else "other ops", row.collective, row.group)
        total = merged.get(key)
        if total is None:
            total = merged[key] = OperatorCalls(row.module, key[1], "", False, row.collective, row.group)
        total.calls += row.calls
        total.flops += row.flops
        total.seconds += row.seconds
        total.bytes += row.bytes
    module_ids = {module: f"module{i}" for i, module in enumerate(sorted({r.module for r in merged.values()}))}
    for module, node in module_ids.items():
        graph.node(node, _short(module), shape="box", style="rounded,filled", fillcolor="#e8eef7")
        parent = module.rpartition(".")[0]
        if parent in module_ids:  # the module tree, dashed
            graph.edge(module_ids[parent], node, style="dashed", color="#8090a0")
    for i, row in enumerate(merged.values()):
        node = f"op{i}"
        if row.collective:
            graph.node(node, f"{row.collective}\\n{row.group}\\n{row.bytes:,} B", shape="box", style="filled",
                       fillcolor="#f7d4d4", color="#b03030")
        else:
            graph.node(node, row.operator, shape="ellipse")
        flops = f"\\n{row.flops / 1e6:,.1f} MFLOP" if row.flops else ""
        graph.edge(module_ids[row.module], node, label=f"{row.calls} calls{flops}\\n{1e3 * row.seconds:.2f} ms",
                   penwidth=str(1 + min(4.0, row.seconds * 1e3 / 5)))
    return graph


def dot_program() -> list[str] | None:
    """Graphviz's ``dot``, or ``graphviz-pure`` (its port, a PyPI wheel the setup script installs), or None."""
    for name in ("dot", "graphviz-pure"):
        path = shutil.which(name) or shutil.which(name, path=os.path.dirname(sys.executable))
        if path:
            return [path]
    return None


def render_svg(dot_path: str, svg_path: str) -> bool:
    """``dot_path`` drawn as SVG by :func:`dot_program`; False where no program is installed."""
    program = dot_program()
    if program is None:
        return False
    subprocess.run([*program, "-Tsvg", dot_path, "-o", svg_path], check=True, capture_output=True, timeout=300)
    return True
