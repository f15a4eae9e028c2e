"""One exception type for every mistake a user can make (bad config, bad data, bad checkpoint).

The CLI turns it into a single ``error: ...`` line and a non-zero exit code instead of a traceback.
"""


class LlamaMegatronError(Exception):
    """A problem with the user's input, reported as one line."""


class ConfigError(LlamaMegatronError):
    """An invalid or inconsistent configuration."""


class DataError(LlamaMegatronError):
    """Malformed, missing or corrupt data files."""


class CheckpointError(LlamaMegatronError):
    """Missing, corrupt or incompatible checkpoints."""
