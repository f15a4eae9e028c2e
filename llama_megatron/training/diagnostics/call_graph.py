"""Which module issued which operator, with its FLOPs, time and (for a collective) bytes and process group.

A :class:`CallGraphRecorder` is a ``TorchDispatchMode``: every aten and c10d operator of the step it is active in
passes through it. Each is attributed to a module (:class:`ModuleAttribution`), to the Python frame of ours that
issued it (``file:line function``: a backward operator to the ``backward`` of our autograd Function running it, or,
run by autograd's engine below no frame of ours, to ``(autograd)``), and counted:
calls, FLOPs by ``torch.utils.flop_counter``'s formulas (the same ``FlopCounterMode`` counts, checked against ours in
``tests/test_training_mfu.py``), host wall time, and for a collective its kind, the bytes of its tensors and its
process group by name (TP, CP, DP, DP x CP, EP, EDP, PP, or the world). :func:`to_dot` draws module -> operator
edges weighted by calls, FLOPs and time, collectives apart, with the ``graphviz`` package (its DOT source);
:func:`render_svg` runs Graphviz's ``dot`` (or ``graphviz-pure``, its port on PyPI) on it.

A forward operator belongs to the innermost module running; a backward operator to the module whose forward made the
autograd node running it. torch's ``ModuleTracker`` guesses the latter from tensor hooks, and keeps a module "running"
in the backward until the gradient of every one of its inputs is complete: an MoE layer's shared expert shares its
input with the router and the routed experts, so their backward GEMMs were credited to it. Nodes are tagged instead
(as the forward ends, see :class:`ModuleAttribution`) and read back with ``torch._C._current_autograd_node()``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import traceback
import weakref
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from llama_megatron.parallel.weight_grad import deferred_origin

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


OUTSIDE = "Global"  # the module of what runs outside every module (ModuleTracker's name for it)
NODE_KEY = "llama_megatron.module"  # the key of an autograd node's metadata naming the module that made it


class _Running(NamedTuple):
    """A module whose forward runs: its name, the graph task it runs in (-1 outside a backward; a recomputed
    forward runs inside one), the first autograd sequence number its forward can give a node, and the nodes its
    inputs came from."""

    module: nn.Module
    name: str
    graph_task: int
    first_node: int
    inputs: frozenset


class ModuleAttribution:
    """Which module an operator belongs to, forward and backward (a context manager: global module hooks).

    Forward: the innermost module whose forward runs. Modules are named as torch's ``ModuleTracker`` names them (the
    first module entered by its class name, its submodules by their dotted path below it).

    Backward: the module whose forward made the autograd node being run. As a module's forward ends, every node
    reachable from its outputs that its forward made (autograd's sequence numbers, per thread, order the nodes
    made: those from its first one on, short of the nodes its inputs came from) and that no module inside it tagged
    first is tagged with its name in the node's ``metadata``. Inner modules end first, so each node is its innermost module's; a module that runs several
    times (a shared expert, a layer recomputed under activation checkpointing) tags each run's nodes; a custom
    autograd Function's node (the TP linears, ``parallel/weight_grad.py``, FP8) is tagged like any other. A forward
    recomputed inside a backward (activation checkpointing) is a forward again: its operators go to its innermost
    module. A parameter's gradient accumulation (``AccumulateGrad``, and what hooks on it issue, such as DeepSpeed's
    gradient reduction) goes to the module holding the parameter. The weight-gradient work a zero-bubble schedule's W
    pass computes outside the backward goes to the module of the node whose backward queued it
    (:func:`~llama_megatron.parallel.weight_grad.deferred_origin`: that node's metadata). Whatever no module made (the loss computed outside
    the model, a W pass's aliases) is ``Global``. A node made in a module's forward but reached from none of its
    outputs (a tensor kept aside for later) is tagged by the first enclosing module that returns it, or by none.
    """

    def __init__(self) -> None:
        self._names: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._named_below: weakref.WeakSet = weakref.WeakSet()
        self._running: list[_Running] = []
        self._holders: dict[int, str] = {}  # id(parameter) -> the module holding it
        self._handles: list = []

    def __enter__(self) -> ModuleAttribution:
        self._handles = [register_module_forward_pre_hook(self._forward_starts),
                         # also when the forward raises (a non-reentrant recomputation stops early by raising)
                         register_module_forward_hook(self._forward_ends, always_call=True)]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def name(self, module: nn.Module) -> str:
        """``Root.layers.3.mlp``: ``ModuleTracker``'s name (a module not seen below another is a root)."""
        if module not in self._names:
            self._names[module] = type(module).__name__
        name = self._names[module]
        if module not in self._named_below:  # every module below it at once: some are never called (a ModuleDict)
            self._named_below.add(module)
            for child_name, child in module.named_children():
                self._names[child] = f"{name}.{child_name}"
                self.name(child)
        return name

    def _forward_starts(self, module: nn.Module, args) -> None:
        name = self.name(module)
        for param in module.parameters(recurse=False):
            self._holders.setdefault(id(param), name)
        leaves, _ = tree_flatten(args)
        inputs = frozenset(t.grad_fn for t in leaves if isinstance(t, torch.Tensor) and t.grad_fn is not None)
        self._running.append(_Running(module, name, torch._C._current_graph_task_id(),
                                      torch.autograd._get_sequence_nr(), inputs))

    def _forward_ends(self, module: nn.Module, args, output) -> None:
        for depth in range(len(self._running) - 1, -1, -1):
            if self._running[depth].module is module:
                running = self._running[depth]
                del self._running[depth:]  # and any inner module a raised exception left behind
                break
        else:  # entered before the hooks were
            return
        if output is not None:
            self._tag(output, running)

    @staticmethod
    def _tag(output, running: _Running) -> None:
        leaves, _ = tree_flatten(output)
        todo = [t.grad_fn for t in leaves if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        seen = set()
        while todo:
            node = todo.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            # made before this forward started (the graph behind it is older still); an input's (the same, where
            # sequence numbers do not tell: they count per thread, and a forward recomputed in a CUDA backward runs
            # on autograd's device thread); a leaf's accumulation (its number is the largest, so that it runs first)
            if (node._sequence_nr() < running.first_node or node in running.inputs
                    or type(node).__name__ == "AccumulateGrad"):
                continue
            node.metadata.setdefault(NODE_KEY, running.name)
            todo.extend(next_node for next_node, _ in node.next_functions)

    def node_owner(self, node) -> str:
        """The module that made autograd node ``node`` (the holder of an ``AccumulateGrad``'s parameter)."""
        if node is None:
            return OUTSIDE
        owner = node.metadata.get(NODE_KEY)
        if owner is None and type(node).__name__ == "AccumulateGrad":
            owner = self._holders.get(id(node.variable))
        return owner or OUTSIDE

    def current(self) -> tuple[str, bool]:
        """(the module of the operator dispatched now, whether it is backward work)."""
        task = torch._C._current_graph_task_id()
        if self._running and self._running[-1].graph_task == task:  # a forward pass (or one recomputed in a backward)
            return self._running[-1].name, task != -1
        if task != -1:
            return self.node_owner(torch._C._current_autograd_node()), True
        origin = deferred_origin()  # a zero-bubble W pass, outside autograd's backward
        if origin is not None:
            return origin.get(NODE_KEY, OUTSIDE), True
        return OUTSIDE, False


class CallGraphRecorder(TorchDispatchMode):
    """Records every operator dispatched while active (one step: frames are read per call)."""

    def __init__(self, groups: dict[int, str] | None = None, pipeline_peers: frozenset[int] = frozenset()) -> None:
        super().__init__()
        self.groups = groups or {}
        self.pipeline_peers = pipeline_peers  # send/recv over the world with one of these is the pipeline's
        self.modules = ModuleAttribution()
        self.rows: dict[tuple, OperatorCalls] = {}

    def __enter__(self):
        self.modules.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        self.modules.__exit__(*exc)

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
        module, backward = self.modules.current()
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
        """Per module: FLOPs (and their forward and backward shares) and seconds of its own operators; per
        collective kind and group: calls and bytes."""
        modules: dict[str, dict] = {}
        collectives: dict[str, dict] = {}
        for row in self.rows.values():
            entry = modules.setdefault(row.module, {"flops": 0, "forward_flops": 0, "backward_flops": 0,
                                                    "seconds": 0.0, "calls": 0})
            entry["flops"] += row.flops
            entry["backward_flops" if row.backward else "forward_flops"] += row.flops
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
