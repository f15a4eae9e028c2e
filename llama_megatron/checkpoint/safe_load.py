"""The one way this package reads a torch file: ``torch.load(weights_only=True)`` plus a minimal allow-list.

A pickle can name any callable and have the loader call it (``__reduce__``), so a checkpoint written by another job
or downloaded could run code the moment it is opened. torch's weights-only unpickler rebuilds tensors, containers
and primitives and refuses every other global before calling anything; DeepSpeed's files need exactly the classes
of :func:`allowed_globals` on top. Every torch file any command opens is read by :func:`load_file`:

- our readers: HF ``pytorch_model.bin``, Meta ``consolidated.XX.pth``, the layer / ``mp_rank`` / ZeRO files of our
  checkpoints (export, reshard, fine-tuning);
- DeepSpeed's engine on resume: :func:`load_through_safe_engine` swaps its checkpoint engine for
  :class:`SafeCheckpointEngine`, whose ``load`` is :func:`load_file` (saving stays DeepSpeed's);
- :func:`verify_checkpoint_dir` reads every ``*.pt`` file of a checkpoint before anything else does, for the
  DeepSpeed code that calls ``torch.load(weights_only=False)`` itself (universal-checkpoint loading,
  ``ds_to_universal``). Only the pickles are read: tensors stay memory-mapped and untouched.
"""

from __future__ import annotations

import functools
import os
import pickle
import re
from typing import Any

import torch

from llama_megatron.errors import CheckpointError


@functools.cache
def allowed_globals() -> tuple[type, ...]:
    """The DeepSpeed classes its checkpoint files pickle: ZeRO stage, (dynamic) loss scaler, bf16 fragment map."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address


def load_file(path: str, *, mmap: bool = True, map_location: Any = "cpu") -> Any:
    """``path`` loaded weights-only; a refused object or an unreadable file is a one-line :class:`CheckpointError`.

    ``mmap`` maps zip archives instead of reading them (tensor pages load when used); legacy (pre-zip) files
    cannot be mapped and are read whole.
    """
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint file missing: {path}")
    with torch.serialization.safe_globals(list(allowed_globals())):
        try:
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
        except pickle.UnpicklingError as exc:
            raise _load_error(path, exc) from None
        except Exception as exc:
            if not (mmap and isinstance(exc, RuntimeError) and "mmap" in str(exc)):
                raise _load_error(path, exc) from None
        try:
            return torch.load(path, map_location=map_location, weights_only=True)
        except Exception as exc:
            raise _load_error(path, exc) from None


def load_state_file(path: str) -> dict:
    """A file that must hold a dict (state dicts, DeepSpeed model and optimizer states), weights-only, mapped."""
    state = load_file(path)
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} does not hold a state dict")
    return state


def _load_error(path: str, exc: Exception) -> CheckpointError:
    refused = _refused_globals(path, exc) if isinstance(exc, pickle.UnpicklingError) else []
    if refused:
        return CheckpointError(
            f"refused {path}: it holds a pickled {', '.join(refused)}, which is not a tensor or an allowed type; "
            "nothing in it was executed (checkpoint files are loaded weights-only)")
    text = str(exc).strip()
    message = text.splitlines()[0] if text else ""
    return CheckpointError(f"cannot read {path} (truncated or not a checkpoint): {type(exc).__name__} "
                           f"{message}".rstrip())


def _refused_globals(path: str, exc: Exception) -> list[str]:
    """Names of the globals the weights-only unpickler refused (from the pickle's opcodes, never executed)."""
    try:
        with torch.serialization.safe_globals(list(allowed_globals())):
            names = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception:  # legacy (pre-zip) files: torch names the global in its message
        names = []
    return names or re.findall(r"GLOBAL (\S+)", str(exc))


def verify_checkpoint_dir(tag_dir: str) -> None:
    """Load every ``*.pt`` file under ``tag_dir`` weights-only (pickles only; tensors stay mapped, unread).

    Symlinked directories are followed, as DeepSpeed's loaders would follow them, each real directory once.
    """
    seen: set[str] = set()
    for root, dirs, files in os.walk(tag_dir, followlinks=True):
        real = os.path.realpath(root)
        if real in seen:
            dirs.clear()
            continue
        seen.add(real)
        dirs.sort()
        for name in sorted(files):
            if name.endswith(".pt"):
                load_file(os.path.join(root, name), mmap=True)


class SafeCheckpointEngine:
    """DeepSpeed's checkpoint engine with ``load`` through :func:`load_file`; every other call goes to ``inner``
    (the engine DeepSpeed configured, so its savers and writers are unchanged)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def load(self, path: str, map_location: Any = None) -> Any:
        return load_file(path, mmap=False, map_location=map_location)

    def __getattr__(self, name: str) -> Any:
        if name == "inner":  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)


def load_through_safe_engine(engine: Any) -> Any:
    """Make a DeepSpeed (or pipeline) engine read checkpoints with :func:`load_file`; returns the engine."""
    if not isinstance(engine.checkpoint_engine, SafeCheckpointEngine):
        engine.checkpoint_engine = SafeCheckpointEngine(engine.checkpoint_engine)
    return engine
