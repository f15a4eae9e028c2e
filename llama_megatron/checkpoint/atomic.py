"""Outputs appear whole or not at all: files and directories are written under a temp name beside the target,
then renamed into place (converters, exports, checkpoint metadata, ``latest``)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager

from llama_megatron.errors import CheckpointError


def write_text_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def check_output(path: str, overwrite: bool, inputs: tuple[str, ...] = ()) -> str:
    """Refuse an existing output (unless ``overwrite``) or one that is, or lies inside, an input."""
    path = os.path.abspath(path)
    for src in inputs:
        src = os.path.abspath(src)
        if path == src or path.startswith(src + os.sep) or src.startswith(path + os.sep):
            raise CheckpointError(f"output {path} overlaps the input {src}: choose another output directory")
    if os.path.lexists(path) and not overwrite:
        raise CheckpointError(f"output {path} already exists (pass --overwrite to replace it)")
    return path


@contextmanager
def atomic_output_dir(path: str, overwrite: bool) -> Iterator[str]:
    """Yield a temp dir to fill; on success it replaces ``path``, on any error it is removed."""
    path = check_output(path, overwrite)
    parent, name = os.path.split(path)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".tmp-{name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if os.path.lexists(path):
        old = os.path.join(parent, f".old-{name}-{os.getpid()}")
        os.replace(path, old)
        os.replace(tmp, path)
        if os.path.isdir(old) and not os.path.islink(old):
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.remove(old)
    else:
        os.replace(tmp, path)
