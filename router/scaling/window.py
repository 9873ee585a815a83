"""RecentWindow: the mean of the samples of the last N seconds, in bounded memory.

Samples are summed into one-second buckets (a deque of at most ``horizon_s`` of them), so a
stream of thousands of inter-token gaps a second costs one addition each and the memory is
a function of the horizon alone. ``mean(window_s)`` is over the buckets whose second falls
within the last ``window_s`` seconds (the current, partial one included). The clock is
injected (``time.monotonic`` by default), so tests drive it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

__all__ = ["RecentWindow"]


class RecentWindow:
    """Recent samples in one-second buckets (module docstring)."""

    def __init__(self, horizon_s: float = 300.0, clock: Callable[[], float] = time.monotonic) -> None:
        if horizon_s < 1:
            raise ValueError(f"horizon_s must be >= 1, got {horizon_s}")
        self.horizon_s = horizon_s
        self._clock = clock
        self._buckets: deque[list[float]] = deque()   # [second, sum, count], oldest first

    def add(self, value: float) -> None:
        second = float(int(self._clock()))
        if self._buckets and self._buckets[-1][0] == second:
            bucket = self._buckets[-1]
            bucket[1] += value
            bucket[2] += 1
        else:
            self._buckets.append([second, value, 1])
            self._prune(second)

    def _prune(self, now: float) -> None:
        while self._buckets and self._buckets[0][0] <= now - self.horizon_s:
            self._buckets.popleft()

    def stats(self, window_s: float) -> tuple[int, float]:
        """(samples, their sum) over the last ``window_s`` seconds."""
        oldest = int(self._clock()) - window_s
        n, total = 0, 0.0
        for second, s, c in reversed(self._buckets):
            if second <= oldest:
                break
            n += int(c)
            total += s
        return n, total

    def mean(self, window_s: float) -> float | None:
        """The mean of the last ``window_s`` seconds' samples; None when there were none."""
        n, total = self.stats(window_s)
        return total / n if n else None
