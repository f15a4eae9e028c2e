"""Reward functions of online RL (GRPO), as TRL's ``GRPOTrainer`` calls them: Python callables a config names,
each called with the keyword arguments ``prompts``, ``completions``, ``completion_ids`` and every other column of
the prompt records (one list entry per completion), returning one float per completion, or None where it does not
apply (it then counts in no group's mean; a completion no function scored gets no advantage:
:func:`llama_megatron.model.grpo.group_advantages`).

A function is named ``package.module:function`` (imported as Python imports it) or ``path/to/file.py:function`` (a
file of the user's, loaded under a module name of its own). The functions run the user's code in the training
process, as TRL's do: a reward is a program, not data.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import numbers
import os
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from llama_megatron.errors import ConfigError, DataError

_SPEC = re.compile(r"^(?P<source>[^:]+):(?P<name>[A-Za-z_]\w*)$")


@dataclass(frozen=True)
class RewardFunction:
    """A loaded reward function and the name a log line and a metric give it (its ``function`` part)."""

    spec: str
    name: str
    function: Callable


def load_reward_function(spec: str, base_dir: str = ".") -> RewardFunction:
    """The callable ``spec`` names (``module:function`` or ``file.py:function``, a relative file from
    ``base_dir``); a ConfigError of one line where it cannot be had."""
    match = _SPEC.match(spec.strip())
    if match is None:
        raise ConfigError(f"reward function {spec!r}: expected module:function or path/to/file.py:function")
    source, name = match["source"], match["name"]
    try:
        if source.endswith(".py"):
            path = source if os.path.isabs(source) else os.path.join(base_dir, source)
            if not os.path.isfile(path):
                raise ConfigError(f"reward function {spec!r}: no file {path}")
            module_name = "llama_megatron_rewards_" + re.sub(r"\W", "_", os.path.abspath(path))
            module = sys.modules.get(module_name)
            if module is None:
                loader_spec = importlib.util.spec_from_file_location(module_name, path)
                module = importlib.util.module_from_spec(loader_spec)
                sys.modules[module_name] = module
                try:
                    loader_spec.loader.exec_module(module)
                except BaseException:
                    del sys.modules[module_name]
                    raise
        else:
            module = importlib.import_module(source)
    except ConfigError:
        raise
    except Exception as exc:  # the user's module: whatever it raises on import is reported in one line
        raise ConfigError(f"reward function {spec!r}: importing {source} raised "
                          f"{type(exc).__name__}: {_one_line(exc)}") from None
    function = getattr(module, name, None)
    if function is None:
        raise ConfigError(f"reward function {spec!r}: {source} has no {name!r}")
    if not callable(function):
        raise ConfigError(f"reward function {spec!r}: {name!r} is not callable")
    # what a function imports only when called (a shipped one's optional extra), found now rather than mid-run
    for package, install in getattr(function, "requires", ()):
        if importlib.util.find_spec(package) is None:
            raise ConfigError(f"reward function {spec!r} needs {package}: {install}")
    return RewardFunction(spec, name, function)


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text[:300] + ("..." if len(text) > 300 else "")


def score(functions: Sequence[RewardFunction], prompts: list, completions: list, completion_ids: list[list[int]],
          columns: dict[str, list] | None = None, **extra) -> torch.Tensor:
    """Every function's reward of every completion, ``[completions, functions]`` float32, NaN where a function
    returned None (or NaN). ``columns``: the prompt records' other columns, one entry per completion; ``extra``:
    further keyword arguments every function gets (what TRL adds, such as the trainer's state). A function that
    raises, returns other than one value per completion, or a value that is not a finite number is a DataError of
    one line naming it."""
    columns = columns or {}
    count = len(completions)
    for key, values in columns.items():
        if len(values) != count:
            raise DataError(f"reward column {key!r} has {len(values)} values for {count} completions")
    rewards = torch.full((count, len(functions)), float("nan"), dtype=torch.float32)
    for j, reward in enumerate(functions):
        try:
            values = reward.function(prompts=prompts, completions=completions, completion_ids=completion_ids,
                                     **columns, **extra)
        except Exception as exc:  # the user's function: reported in one line, with its name
            raise DataError(f"reward function {reward.name!r} raised {type(exc).__name__}: {_one_line(exc)}") \
                from None
        try:
            values = list(values)
        except TypeError:
            raise DataError(f"reward function {reward.name!r} returned {type(values).__name__}, not one value "
                            f"per completion") from None
        if len(values) != count:
            raise DataError(f"reward function {reward.name!r} returned {len(values)} rewards for {count} "
                            f"completions (one per completion)")
        for i, value in enumerate(values):
            if value is None:  # TRL's None: NaN, left out of its group's statistics
                continue
            number = isinstance(value, numbers.Real) or (isinstance(value, torch.Tensor) and value.numel() == 1)
            if not number or math.isinf(float(value)):
                raise DataError(f"reward function {reward.name!r} returned {value!r} for completion {i}: a finite "
                                f"number or None")
            rewards[i, j] = float(value)
    return rewards
