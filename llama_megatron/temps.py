"""What writers killed without cleaning up (SIGKILL: the launcher's 30 s after SIGTERM, the OOM killer) leave
beside their outputs, and its removal: every writer here writes under a temp name that carries its pid, so a
later writer can tell a dead one's leftovers from a live one's."""

from __future__ import annotations

import contextlib
import os
import re
import shutil


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` runs on this host (one of another user's counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def reclaim_temps(directory: str, pattern: str, only_dead: bool = True) -> list[str]:
    """Remove what killed writers left in ``directory``: entries whose names match ``pattern`` (a regex with a
    ``pid`` group), where that process is gone (every match without ``only_dead``: the caller owns the directory).
    A writer killed by SIGKILL (the launcher's 30 s after SIGTERM, the OOM killer) never cleans up after itself."""
    removed = []
    regex = re.compile(pattern)
    for entry in os.listdir(directory) if os.path.isdir(directory) else []:
        match = regex.fullmatch(entry)
        if not match or (only_dead and pid_alive(int(match.group("pid")))):
            continue
        path = os.path.join(directory, entry)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.remove(path)
        removed.append(entry)
    return removed
