"""One exception type for every mistake a user can make (bad config, bad data, bad checkpoint), and for the faults a
long run stops on.

The CLI turns it into a single ``error: ...`` line and the exception's exit code instead of a traceback: 2 for bad
input (found before anything runs, wherever it can be known then), 3 when the step guard stops a diverging run,
4 when a checkpoint could not be written, 5 when a rank made no progress for ``distributed.timeout_minutes``. Under a
launcher the line is printed once per launch, by the first rank that knows it (:func:`report_once`).
"""

import os
import sys
from collections.abc import Callable

from llama_megatron import host_sockets


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


# How long the rank that reported an error waits for the launch's other ranks to say they stopped too, before it
# exits: while it holds the report, a rank that fails later stays silent. Before any process group the ranks reach
# their checks seconds apart (imports on a loaded host); once process groups are up an error all ranks agreed on
# reaches each within milliseconds, and a rank's own error leaves the others waiting in a collective.
REPORT_HOLD_S = 30.0
REPORT_HOLD_GROUPS_UP_S = 3.0


def _local_ranks() -> int:
    """The processes this one's launcher started on this host, children of one parent: the deepspeed launcher's
    (LOCAL_SIZE), torchrun's and srun's (LOCAL_WORLD_SIZE, set by torchrun or read from SLURM); 1 without one, or
    where something else set RANK (processes started one by one share no parent to meet at)."""
    env = os.environ
    size = env.get("LOCAL_SIZE") or (env.get("LOCAL_WORLD_SIZE")
                                     if "TORCHELASTIC_RUN_ID" in env or "SLURM_STEP_NUM_TASKS" in env else None)
    try:
        return int(size or 1)
    except ValueError:
        return 1


def _process_groups_up() -> bool:
    dist = sys.modules.get("torch.distributed")  # never imported here for this: only asked once something did
    return bool(dist is not None and dist.is_available() and dist.is_initialized())


def report_once(error: BaseException | str) -> None:
    """``error: ...`` once per launch: every rank of a launch that fails prints nothing but the first, which holds
    a name on the host (:func:`llama_megatron.host_sockets.claim`) until the launcher's other ranks have checked in
    (they exit with the same code, silently) or :data:`REPORT_HOLD_S` passed. One process, or a host without
    abstract sockets: printed as it is."""
    ranks = _local_ranks()
    if ranks <= 1 or not host_sockets.supported():
        print_error(error)
        return
    name = f"error/{host_sockets.launcher_key()}"
    try:
        holder = host_sockets.claim(name)
    except OSError:
        print_error(error)
        return
    if holder is None:  # another rank of this launch reported it: check in, so it stops waiting once all did
        host_sockets.ask(name, timeout_s=2.0)
        return
    with holder:
        print_error(error)
        sys.stdout.flush()
        hold = REPORT_HOLD_GROUPS_UP_S if _process_groups_up() else REPORT_HOLD_S
        host_sockets.answer(holder, b"", ranks - 1, hold)


def exit_code_of(run: Callable[[], int | None]) -> int:
    """``run()``'s exit code for a command's ``main``: 0 when it returns nothing, a :class:`LlamaMegatronError`'s code
    after its one line (once per launch), 130 on an interrupt (a second SIGINT while a stop is pending in training,
    any SIGINT elsewhere)."""
    try:
        return int(run() or 0)
    except LlamaMegatronError as exc:
        report_once(exc)
        return exc.exit_code
    except KeyboardInterrupt:
        report_once("interrupted")
        return 130
