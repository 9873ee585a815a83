"""How a choice is served (:class:`Route`), where it starts (:class:`Plan`), and the router's
configured :data:`Mode` that decides it.

One vocabulary for the path a request takes, used by the plan, the request log's ``mode``
and the ``kvrouter_route_kind_total{kind}`` metric. It is the outcome of a decision; the
router's configured ``Mode`` (``disaggregated`` | ``colocated`` | ``auto``; ``RouterConfig.mode``,
``--mode``) is the policy that makes it, and a worker ``Phase`` (``prefill`` | ``decode`` |
``full``) is one step of it on one worker.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Literal

from engine.api.generate import Phase
from router.workers.pool import WorkerHandle

__all__ = ["Mode", "MODES", "Route", "Plan"]

Mode = Literal["disaggregated", "colocated", "auto"]
MODES: tuple[Mode, ...] = ("disaggregated", "colocated", "auto")


class Route(StrEnum):
    """The path of one choice through the fleet."""

    DISAGGREGATED = "disaggregated"   # prefill worker -> store -> decode worker
    COLOCATED = "colocated"           # --mode colocated: one worker runs phase "full"
    AUTO_LOCAL = "auto-local"         # --mode auto: the decode worker prefills itself ("full")
    AUTO_REMOTE = "auto-remote"       # --mode auto: disaggregated, the prompt was long enough
    STORE_DOWN = "store-down"         # would be disaggregated, but the store (the handoff) is
                                      # down: the decode worker prefills itself ("full")

    @property
    def first_phase(self) -> Phase:
        """The first worker's phase: ``prefill`` (then a decode phase elsewhere) or ``full``."""
        return "prefill" if self in (Route.DISAGGREGATED, Route.AUTO_REMOTE) else "full"


@dataclass(frozen=True, slots=True)
class Plan:
    """Where a choice starts: its route, the first worker, and what that worker is expected
    to compute of the prompt (``uncached_tokens``, from the prefill estimate)."""

    route: Route
    first: WorkerHandle
    uncached_tokens: int
