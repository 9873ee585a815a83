"""A configuration's capacity: the highest request rate at which it still meets the objectives
for at least a target share of its requests, found by a bounded search on the rate.

The search (``find_capacity``), given ``attains(rate) -> attainment`` (one simulated point) and
a first guess:

1. **Bracket**: from the guess, double the rate while it passes (attainment >= target) or halve
   it while it fails, until one rate passes and a higher one fails. A configuration that fails
   at ``guess / 2**max_halvings`` has capacity 0; one that still passes after
   ``max_doublings`` is reported as at least the last rate passed (``upper`` None).
2. **Bisect** on the geometric mean of the bracket until ``upper / rate <= 1 + precision``
   (5% by default).

The capacity is the highest rate passed (``rate``); the true crossing lies in ``[rate, upper)``,
so ``uncertainty = upper / rate - 1`` is the relative width of what is not known. A point's
attainment is taken as non-increasing in the rate; where a simulation is not (a lucky point
past an unlucky one), the bracket still ends between a rate that passed and a higher one that
failed, which is what the capacity means.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["Capacity", "SearchSettings", "find_capacity"]


@dataclass(frozen=True)
class SearchSettings:
    target: float = 0.9          # the attainment a rate must keep
    precision: float = 0.05      # stop when upper / rate <= 1 + precision
    max_doublings: int = 6
    max_halvings: int = 8

    def __post_init__(self) -> None:
        if not 0 < self.target <= 1:
            raise ValueError(f"the attainment target must be in (0, 1], got {self.target}")
        if self.precision <= 0:
            raise ValueError(f"the search's precision must be positive, got {self.precision}")


@dataclass
class Capacity:
    """The outcome of one search (see the module docstring)."""

    rate: float                        # the highest rate that met the target (0: none did)
    upper: float | None                # the lowest rate above it that failed (None: none failed)
    points: list[tuple[float, float]] = field(default_factory=list)   # (rate, attainment), in search order

    @property
    def uncertainty(self) -> float | None:
        """``upper / rate - 1``: how much higher the true capacity may be (None: unbounded)."""
        if self.upper is None or self.rate <= 0:
            return None
        return self.upper / self.rate - 1

    def attainment_at(self, rate: float) -> float | None:
        return next((a for r, a in self.points if r == rate), None)

    def first_failure(self) -> tuple[float, float] | None:
        """The lowest failing rate tried, with its attainment."""
        return None if self.upper is None else (self.upper, self.attainment_at(self.upper) or 0.0)

    def to_json(self) -> dict[str, object]:
        return {"rate": self.rate, "upper": self.upper, "uncertainty": self.uncertainty,
                "points": [{"rate": r, "attainment": a} for r, a in sorted(self.points)]}


def find_capacity(attains: Callable[[float], float], guess: float,
                  s: SearchSettings = SearchSettings()) -> Capacity:
    """The bounded search of the module docstring."""
    if not (guess > 0 and math.isfinite(guess)):
        raise ValueError(f"the search needs a positive first rate, got {guess}")
    tried: dict[float, float] = {}

    def ok(rate: float) -> bool:
        if rate not in tried:
            tried[rate] = attains(rate)
        return tried[rate] >= s.target

    lo: float | None = None
    hi: float | None = None
    rate = guess
    if ok(rate):
        lo = rate
        for _ in range(s.max_doublings):
            rate *= 2
            if not ok(rate):
                hi = rate
                break
            lo = rate
    else:
        hi = rate
        for _ in range(s.max_halvings):
            rate /= 2
            if ok(rate):
                lo = rate
                break
            hi = rate
    if lo is None or hi is None:
        return Capacity(lo or 0.0, hi, list(tried.items()))
    while hi / lo > 1 + s.precision:
        mid = math.sqrt(lo * hi)
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return Capacity(lo, hi, list(tried.items()))
