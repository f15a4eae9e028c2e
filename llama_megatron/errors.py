"""One exception type for every mistake a user can make (bad config, bad data, bad checkpoint).

The CLI turns it into a single ``error: ...`` line and a non-zero exit code instead of a traceback.
"""

import sys


class LlamaMegatronError(Exception):
    """A problem with the user's input, reported as one line."""


class ConfigError(LlamaMegatronError):
    """An invalid or inconsistent configuration."""


class DataError(LlamaMegatronError):
    """Malformed, missing or corrupt data files."""


class CheckpointError(LlamaMegatronError):
    """Missing, corrupt or incompatible checkpoints."""


def print_error(error: BaseException | str) -> None:
    """``error: ...`` on stderr in one write. The ranks of a launch share that stream, and ``print`` writes the
    newline separately (unbuffered), so two ranks' lines could run together."""
    sys.stderr.write(f"error: {error}\n")
    sys.stderr.flush()
