"""The training JSON read as typed sections: each section's keys checked against its dataclass (unknown keys, and
values of the wrong type, are one line naming the key; a JSON list becomes the tuple a field declares), and ``--set
a.b.c=value`` overrides applied to the JSON before it is read; the sections with checks of their own."""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass
from typing import Any

from llama_megatron.errors import ConfigError


def typed_section(section_cls, name: str, value: Any):
    if not isinstance(value, dict):
        raise ConfigError(f"training config section {name!r} must be an object")
    known = {f.name for f in dataclasses.fields(section_cls)}
    unknown = set(value) - known
    if unknown:
        raise ConfigError(f"unknown keys in {name!r}: {', '.join(sorted(unknown))}")
    value = dict(value)
    hints = typing.get_type_hints(section_cls)
    for key, item in value.items():
        value[key] = _typed(item, hints[key], f"{name}.{key}")
    return section_cls(**value)


def _typed(value: Any, hint: Any, key: str) -> Any:
    """``value`` checked against a section field's type (int, float, bool, str, tuple of them, or None where the
    field allows it); a JSON list becomes the tuple. One-line ConfigError naming the key otherwise."""
    options = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    if value is None and type(None) in options:
        return None
    for option in options:
        if option is bool and isinstance(value, bool):
            return value
        if option is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if option is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if option is str and isinstance(value, str):
            return value
        if typing.get_origin(option) is tuple and isinstance(value, (list, tuple)):
            args = typing.get_args(option)
            item_hints = [args[0]] * len(value) if len(args) == 2 and args[1] is Ellipsis else list(args)
            if len(item_hints) == len(value):
                try:
                    return tuple(_typed(v, h, key) for v, h in zip(value, item_hints))
                except ConfigError:
                    pass
    names = " or ".join(_type_name(o) for o in options)
    raise ConfigError(f"{key} must be {names}, got {json.dumps(value) if _jsonable(value) else repr(value)}")


def _type_name(hint: Any) -> str:
    if hint is type(None):
        return "null"
    if typing.get_origin(hint) is tuple:
        return "a list"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(hint, str(hint))


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def apply_override(data: dict[str, Any], item: str) -> None:
    """``a.b.c=value``; value is JSON when it parses as JSON, else a string."""
    if "=" not in item:
        raise ConfigError(f"--set expects key=value, got {item!r}")
    key, raw = item.split("=", 1)
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    parts = key.split(".")
    node = data
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {key}: {part!r} is not a section")
        node = child
    node[parts[-1]] = value


def read_config_data(path: str, overrides: list[str] | None = None) -> dict:
    """A training config file's JSON with the ``--set`` overrides applied, not yet checked (``from_dict`` checks)."""
    from llama_megatron.config import read_json

    data = read_json(path, "training config")
    for item in overrides or []:
        apply_override(data, item)
    return data


@dataclass
class EvalConfig:
    interval: int = 0  # steps between evaluations; 0: never
    iters: int = 1  # global batches of the validation split per evaluation
    # lm-evaluation-harness tasks run at each evaluation on the model being trained: lm-eval task names, the ones
    # shipped in data/eval/tasks, or task YAML files (docs/evaluation.md); [] none
    tasks: tuple[str, ...] = ()
    tasks_limit: int | None = None  # the first N documents of each task at each evaluation; null: all
    tasks_fewshot: int | None = None  # few-shot examples per task; null: each task's own
    tasks_interval: int = 0  # steps between the task runs, a multiple of eval.interval; 0: at every evaluation
    # also write every document's requests, responses and metrics (lm-eval's samples) beside each evaluation's
    # results, output_dir/tasks/step<N>.samples.jsonl
    tasks_log_samples: bool = False

    def tasks_due(self, step: int) -> bool:
        """Whether the tasks run at ``step`` (an evaluation's)."""
        return bool(self.tasks and self.interval) and step % (self.tasks_interval or self.interval) == 0

    def check(self) -> None:
        if self.interval < 0 or self.iters < 1:
            raise ConfigError("eval.interval must be >= 0 and eval.iters >= 1")
        if not self.tasks:
            return
        if not all(self.tasks):
            raise ConfigError(f"eval.tasks must list task names or YAML files, got {list(self.tasks)!r}")
        if not self.interval:  # no evaluation: the tasks never run (eval.interval 0 turns a config's evaluation off)
            return
        if self.tasks_interval < 0 or self.tasks_interval % self.interval:
            raise ConfigError(f"eval.tasks_interval {self.tasks_interval} must be a multiple of eval.interval "
                              f"{self.interval} (the tasks run at evaluations), or 0: at every evaluation")
        if self.tasks_limit is not None and self.tasks_limit < 1 or (self.tasks_fewshot or 0) < 0:
            raise ConfigError("eval.tasks_limit must be >= 1 (or null) and eval.tasks_fewshot >= 0 (or null)")
