"""Outputs appear whole or not at all: files and directories are written under a temp name beside the target,
then renamed into place (converters, exports, checkpoint metadata, ``latest``)."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

from llama_megatron.errors import CheckpointError
from llama_megatron.temps import reclaim_temps


def write_text_atomic(path: str, text: str) -> None:
    """``path`` replaced by ``text`` whole. The temp file is made by ``mkstemp`` (O_CREAT | O_EXCL): a symlink
    planted under a predictable temp name would otherwise have its target truncated and written."""
    parent, name = os.path.split(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f"{name}.tmp.{os.getpid()}.", dir=parent)
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)  # what open() would have made; mkstemp makes 0600
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def check_output(path: str, overwrite: bool, inputs: tuple[str, ...] = ()) -> str:
    """Refuse an existing output (unless ``overwrite``) or one that is, or lies inside, an input. Paths are
    compared as resolved (``realpath``): an output reached through a symlink to the input is the input, and
    ``--overwrite`` would delete it."""
    path = os.path.abspath(path)
    real = os.path.realpath(path)
    for src in inputs:
        src = os.path.realpath(src)
        if real == src or real.startswith(src + os.sep) or src.startswith(real + os.sep):
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
    reclaim_temps(parent, rf"\.(tmp|old)-{re.escape(name)}-(?P<pid>\d+)")
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
