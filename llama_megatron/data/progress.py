"""A dependency-free progress line for long data jobs: docs/s and tokens/s, no notion of ranks.

On a terminal the line is redrawn in place; in a log file (CI, sbatch) one line is appended per interval so the
log stays readable.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


def _human(x: float) -> str:
    for unit in ("", "K", "M", "G", "T"):
        if abs(x) < 1000:
            return f"{x:.1f}{unit}" if unit else f"{x:.0f}"
        x /= 1000
    return f"{x:.1f}P"


class Progress:
    def __init__(
        self, label: str, interval: float = 2.0, stream: TextIO | None = None, enabled: bool = True
    ) -> None:
        self.label = label
        self.interval = interval
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.start = time.perf_counter()
        self._last = self.start
        self.docs = 0
        self.tokens = 0
        self.bytes = 0

    def update(self, docs: int, tokens: int, nbytes: int = 0) -> None:
        self.docs += docs
        self.tokens += tokens
        self.bytes += nbytes
        now = time.perf_counter()
        if self.enabled and now - self._last >= self.interval:
            self._last = now
            self._emit(final=False)

    def line(self) -> str:
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        return (
            f"{self.label}: {self.docs:,} docs, {_human(self.tokens)} tokens, {_human(self.bytes)}B in "
            f"{elapsed:.1f}s | {_human(self.docs / elapsed)} docs/s, {_human(self.tokens / elapsed)} tokens/s"
        )

    def _emit(self, final: bool) -> None:
        if self.tty:
            self.stream.write("\r" + self.line() + ("\n" if final else ""))
        else:
            self.stream.write(self.line() + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self._emit(final=True)

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start
