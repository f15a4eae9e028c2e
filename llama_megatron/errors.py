"""One exception type for every mistake a user can make (bad config, bad data, bad checkpoint), and for the faults a
long run stops on.

The CLI turns it into a single ``error: ...`` line and the exception's exit code instead of a traceback: 2 for bad
input (found before anything runs, wherever it can be known then), 3 when the step guard stops a diverging run,
4 when a checkpoint could not be written, 5 when a rank made no progress for ``distributed.timeout_minutes``.
"""

import sys
from collections.abc import Callable


class LlamaMegatronError(Exception):
    """A problem with the user's input, reported as one line."""

    exit_code = 2


class ConfigError(LlamaMegatronError):
    """An invalid or inconsistent configuration."""


class DataError(LlamaMegatronError):
    """Malformed, missing or corrupt data files."""


class CheckpointError(LlamaMegatronError):
    """Missing, corrupt or incompatible checkpoints."""


class TrainingStopped(LlamaMegatronError):
    """The step guard stopped the run: too many consecutive bad (non-finite, skipped or spiking) steps."""

    exit_code = 3


class SaveFailed(LlamaMegatronError):
    """A checkpoint could not be written (disk full, I/O error); the previous one is intact."""

    exit_code = 4


class Stalled(LlamaMegatronError):
    """No progress for ``distributed.timeout_minutes`` (training/faults/watchdog.py): a rank stopped or a collective hangs."""

    exit_code = 5


def print_error(error: BaseException | str) -> None:
    """``error: ...`` on stderr in one write. The ranks of a launch share that stream, and ``print`` writes the
    newline separately (unbuffered), so two ranks' lines could run together."""
    sys.stderr.write(f"error: {error}\n")
    sys.stderr.flush()


def exit_code_of(run: Callable[[], int | None]) -> int:
    """``run()``'s exit code for a command's ``main``: 0 when it returns nothing, a :class:`LlamaMegatronError`'s code
    after its one line, 130 on an interrupt (a second SIGINT while a stop is pending in training, any SIGINT
    elsewhere)."""
    try:
        return int(run() or 0)
    except LlamaMegatronError as exc:
        print_error(exc)
        return exc.exit_code
    except KeyboardInterrupt:
        print_error("interrupted")
        return 130
