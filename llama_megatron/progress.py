"""Dependency-free progress lines for long offline jobs: preprocessing (docs/s, tokens/s) and conversion or
export (parameters done of all, bytes, ETA). No notion of ranks.

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


class _ProgressLine:
    def __init__(self, label: str, interval: float, stream: TextIO | None, enabled: bool) -> None:
        self.label = label
        self.interval = interval
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.start = time.perf_counter()
        self._last = self.start

    def line(self) -> str:
        raise NotImplementedError

    def _tick(self) -> None:
        now = time.perf_counter()
        if self.enabled and now - self._last >= self.interval:
            self._last = now
            self._emit(final=False)

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


class Progress(_ProgressLine):
    """Documents and tokens of a data job."""

    def __init__(self, label: str, interval: float = 2.0, stream: TextIO | None = None,
                 enabled: bool = True) -> None:
        super().__init__(label, interval, stream, enabled)
        self.docs = 0
        self.tokens = 0
        self.bytes = 0

    def update(self, docs: int, tokens: int, nbytes: int = 0) -> None:
        self.docs += docs
        self.tokens += tokens
        self.bytes += nbytes
        self._tick()

    def line(self) -> str:
        elapsed = max(self.elapsed, 1e-9)
        return (
            f"{self.label}: {self.docs:,} docs, {_human(self.tokens)} tokens, {_human(self.bytes)}B in "
            f"{elapsed:.1f}s | {_human(self.docs / elapsed)} docs/s, {_human(self.tokens / elapsed)} tokens/s"
        )


class TaskProgress(_ProgressLine):
    """``done`` of ``total`` items (parameters of a conversion), bytes written, rate and ETA."""

    def __init__(self, label: str, total: int, interval: float = 2.0, stream: TextIO | None = None,
                 enabled: bool = True, unit: str = "tensors") -> None:
        super().__init__(label, interval, stream, enabled)
        self.total, self.unit = total, unit
        self.done = 0
        self.bytes = 0

    def advance(self, items: int = 1, nbytes: int = 0) -> None:
        self.done += items
        self.bytes += nbytes
        self._tick()

    def line(self) -> str:
        elapsed = max(self.elapsed, 1e-9)
        rate = self.bytes / elapsed
        eta = elapsed * (self.total - self.done) / self.done if self.done else 0.0
        written = f", {_human(self.bytes)}B" if self.bytes else ""
        speed = f"{_human(rate)}B/s, " if self.bytes else ""
        return (f"{self.label}: {self.done}/{self.total} {self.unit}{written} in {elapsed:.1f}s | "
                f"{speed}ETA {eta:.0f}s")
