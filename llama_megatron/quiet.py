"""What the libraries print that a user can do nothing about, kept out of the run's output unless
``LLAMA_MEGATRON_VERBOSE=1``: torch's deprecation of a call DeepSpeed makes everywhere, DeepSpeed's accelerator guess
and its pipeline module's start-up prints."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import sys
import warnings
from collections.abc import Iterator

VERBOSE_ENV = "LLAMA_MEGATRON_VERBOSE"  # "1": keep DeepSpeed's start-up prints and torch's deprecation warnings


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV, "") not in ("", "0")


class _DropAcceleratorGuess(logging.Filter):
    """DeepSpeed's "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it.",
    which every process that imports it prints on a host without CUDA (each rank, the launcher twice): the run's
    first line says which device it trains on instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Setting accelerator to CPU")


def quiet_library_warnings() -> None:
    """Torch deprecates ``all_gather_into_tensor``, which DeepSpeed calls from many places, each warning once per
    rank, and DeepSpeed guesses its accelerator aloud in every process (:class:`_DropAcceleratorGuess`): nothing a
    user can change, so both are filtered unless ``LLAMA_MEGATRON_VERBOSE=1``. Called as a command starts, before
    DeepSpeed is imported (its logger keeps a filter added before it configures it), and again (idempotent) as the
    process group starts."""
    if verbose():
        return
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.all_gather_into_tensor` is deprecated",
                            category=FutureWarning)
    deepspeed_logger = logging.getLogger("DeepSpeed")
    if not any(isinstance(f, _DropAcceleratorGuess) for f in deepspeed_logger.filters):
        deepspeed_logger.addFilter(_DropAcceleratorGuess())


# What DeepSpeed's PipelineModule prints on rank 0 as it is built: its seed settings, the topology and the layers
# of each stage (the last one's with its loss function)
_DEEPSPEED_PRINTS = re.compile(r"^(SEED_LAYERS=\S* BASE_SEED=\S* SEED_FN=\S*|Using topology: .*|stage=\d+ layers=\d+"
                               r"| +\d+: \S+|  loss: \S+)$")


@contextlib.contextmanager
def without_deepspeed_prints() -> Iterator[None]:
    """Drop DeepSpeed's start-up prints (``_DEEPSPEED_PRINTS``) from stdout inside the block, unless
    ``LLAMA_MEGATRON_VERBOSE=1``; any other line printed there passes through, after the block."""
    if verbose():
        yield
        return
    buffer = io.StringIO()
    try:
        with contextlib.redirect_stdout(buffer):
            yield
    finally:
        kept = [line for line in buffer.getvalue().splitlines(keepends=True)
                if not _DEEPSPEED_PRINTS.match(line.rstrip("\n"))]
        if kept:
            sys.stdout.write("".join(kept))
            sys.stdout.flush()
