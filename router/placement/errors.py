"""What placement raises when a choice cannot be served; ``router.http.errors`` alone turns
these (and the workers' errors) into HTTP statuses and OpenAI error bodies.

Raised by ``router.placement.orchestrator`` / ``failover`` before or during a choice:

- :class:`NoCapacity`: no worker can take the request now (none serves the model, none has
  room for its KV, or every one tried failed it). Try again later (HTTP 503).
- From the workers layer, passed through unchanged (``router.workers.client``):
  ``WorkerRejected`` (a worker refused the request as malformed: the client's fault, not
  retried) and its subclass ``KeyMismatch`` (the prefill and decode workers disagree on the
  prompt's block keys: a deployment fault).
"""

from __future__ import annotations

__all__ = ["PlacementError", "NoCapacity"]


class PlacementError(Exception):
    """A choice could not be placed; the message says why and what to do."""


class NoCapacity(PlacementError):
    """No worker can serve the request now: start one, or retry when the fleet has room."""
