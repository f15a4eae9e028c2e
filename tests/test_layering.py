"""The package's floors, bottom up: config/families/errors/progress/temps/host_sockets/quiet/process_exit/
lm_eval_registration, parallel, model, data, checkpoint, training, commands.

Inside training/ the rooms have floors too, bottom up: config and objectives, faults/, pipeline/ (schedules) and background_save; checkpointing, save_dir, checkpointer,
resume and engine/; diagnostics/; run/ (the setup path and the loop). A module may import only from its own floor or a
lower one, and no two modules, folders or training rooms import each other in a loop. Imports are read from the source (every ``import`` statement, also those inside functions), so a
lazy import cannot hide a cycle.
"""

from __future__ import annotations

import ast
import os

import llama_megatron

PACKAGE = os.path.dirname(llama_megatron.__file__)
FLOORS = {  # top-level module or folder -> floor
    "errors": 0, "config": 0, "families": 0, "family_checks": 0, "progress": 0, "temps": 0, "host_sockets": 0, "quiet": 0, "process_exit": 0,
    "lm_eval_registration": 0,
    "parallel": 1, "model": 2, "data": 3, "checkpoint": 4, "training": 5,
    "commands": 6, "cli": 6, "train": 7, "__main__": 7, "__init__": 0,
}
TRAINING_ROOMS = {  # module or folder inside training/ -> floor; nothing below run/ imports the run loop
    "__init__": 0, "config": 0, "config_sections": 0, "objectives": 0, "faults": 0, "pipeline": 0,
    "background_save": 0, "checkpointing": 1, "checkpointer": 1, "resume": 1, "save_dir": 1, "engine": 1, "diagnostics": 2, "run": 3,
    "planner": 3,
}


def _module_imports() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            rel = os.path.relpath(path, os.path.dirname(PACKAGE))[:-3].replace(os.sep, ".")
            module = rel.removesuffix(".__init__")
            targets = set()
            for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
                if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    targets.add(node.module)
                    targets.update(f"{node.module}.{a.name}" for a in node.names)
                elif isinstance(node, ast.Import):
                    targets.update(a.name for a in node.names)
            graph[module] = {t for t in targets if t.startswith("llama_megatron.")}
    # keep only targets that are modules (``from pkg import name`` may name a function)
    return {m: {t for t in ts if t in graph} for m, ts in graph.items()}


def _floor(module: str) -> int:
    part = module.split(".")[1] if "." in module else "__init__"
    return FLOORS[part]


def _room(module: str) -> str | None:
    parts = module.split(".")
    if parts[1:2] != ["training"]:
        return None
    return parts[2] if len(parts) > 2 else "__init__"


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_every_module_has_a_floor() -> None:
    unknown = sorted(m for m in _module_imports() if m != "llama_megatron" and m.split(".")[1] not in FLOORS)
    assert not unknown, f"add these to FLOORS: {unknown}"


def test_no_module_imports_a_higher_floor() -> None:
    upward = [f"{m} -> {t}" for m, ts in _module_imports().items() for t in ts
              if m != "llama_megatron" and _floor(m) < _floor(t)]
    assert not upward, "imports that go up a floor:\n" + "\n".join(sorted(upward))


def test_no_import_cycles_between_modules_or_folders() -> None:
    graph = _module_imports()
    assert _cycle(graph) is None, f"module import cycle: {' -> '.join(_cycle(graph))}"
    folders: dict[str, set[str]] = {}
    for module, targets in graph.items():
        src = module.split(".")[1] if "." in module else "__init__"
        folders.setdefault(src, set()).update(t.split(".")[1] for t in targets if t.split(".")[1] != src)
    assert _cycle(folders) is None, f"folder import cycle: {' -> '.join(_cycle(folders))}"


def test_the_checker_sees_a_cycle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_every_training_module_has_a_room() -> None:
    unknown = sorted(m for m in _module_imports() if (room := _room(m)) is not None and room not in TRAINING_ROOMS)
    assert not unknown, f"add these to TRAINING_ROOMS: {unknown}"


def test_no_training_room_imports_a_higher_one() -> None:
    upward = [f"{m} -> {t}" for m, ts in _module_imports().items() for t in ts
              if _room(m) is not None and _room(t) is not None and TRAINING_ROOMS[_room(m)] < TRAINING_ROOMS[_room(t)]]
    assert not upward, "imports that go up a room in training/:\n" + "\n".join(sorted(upward))


def test_no_import_cycles_between_training_rooms() -> None:
    rooms: dict[str, set[str]] = {}
    for module, targets in _module_imports().items():
        if (src := _room(module)) is not None:
            rooms.setdefault(src, set()).update(r for t in targets if (r := _room(t)) not in (None, src))
    assert _cycle(rooms) is None, f"training room import cycle: {' -> '.join(_cycle(rooms))}"


def test_files_and_functions_stay_short() -> None:
    """Short files with one job each: no module of the package over 450 lines, no function over 80 (the run loop's
    steps, the setup path's, a schedule's record: each split where it grew)."""
    long_files, long_functions = [], []
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            source = open(path, encoding="utf-8").read()
            rel = os.path.relpath(path, PACKAGE)
            if source.count("\n") > 450:
                long_files.append(f"{rel}: {source.count(chr(10))} lines")
            long_functions += [f"{rel}: {node.name} ({node.end_lineno - node.lineno + 1} lines)"
                               for node in ast.walk(ast.parse(source))
                               if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                               and node.end_lineno - node.lineno + 1 > 80]
    assert not long_files and not long_functions, "\n".join(long_files + long_functions)
