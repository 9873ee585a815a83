"""Colocated mode's load guard (SGLang's cache-aware router's balance thresholds): see
``router.placement.decode``, which applies it. Its own module, free of the router's heavier
imports, so that the CLI can read its defaults for ``--help``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from router.workers.pool import WorkerHandle

__all__ = ["Balance"]

H = TypeVar("H", bound="WorkerHandle")


@dataclass(frozen=True, slots=True)
class Balance:
    """The colocated choice's load guard (see the module docstring). A worker stays a candidate
    while its load (queued + running requests, ``WorkerLoad.load``) is at most
    ``max(least + abs_requests, least x rel)``, ``least`` the least loaded candidate's. A large
    ``abs_requests`` turns the guard off; ``abs_requests=0, rel=1`` keeps only the least loaded."""

    abs_requests: int = 2
    rel: float = 1.1

    def __post_init__(self) -> None:
        if self.abs_requests < 0:
            raise ValueError(f"balance abs_requests must be >= 0, got {self.abs_requests}")
        if self.rel < 1:
            raise ValueError(f"balance rel must be >= 1, got {self.rel}")

    def within(self, handles: Sequence[H]) -> list[H]:
        """The candidates not loaded far past the least loaded one (all of them, in order,
        when the load is even)."""
        if len(handles) < 2:
            return list(handles)
        loads = [h.load.load for h in handles]
        least = min(loads)
        bound = max(least + self.abs_requests, least * self.rel)
        return [h for h, n in zip(handles, loads) if n <= bound]
