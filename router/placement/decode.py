"""The decode choice: the one place that decides which worker decodes a request.

The orchestrator asks it when it plans (``colocated``: which workers may run the request at
all; ``auto``: the would-be decode worker) and the failover logic asks it for every decode
phase (the handoff after a prefill, a resume after a failure).

Rule: among the candidates, those with free KV for the request now (free = total - max(used
as reported, blocks this router booked there); the request needs
``engine.api.blocks.blocks_needed(tokens, max_tokens)``); when none has, those whose whole
cache could hold it (the request waits in that worker's queue, as it would in a single
engine, rather than failing while the fleet is busy); then the least loaded, then the most
free blocks, then the worker id. None: the request fits in no worker's cache.

The colocated choice has one more step (:class:`Balance`, SGLang's cache-aware router's
balance thresholds): the prefill policy scores prompt work alone (queued prefills, the cached
prefix), not the decodes a worker is running, so a prefix many requests share would pile them
all onto the workers that cache it while the rest of the fleet idles, and those workers'
decodes slow down (the planner's simulated 32-64 GPU fleets, docs/benchmarks.md). So the
workers loaded far past the least loaded candidate (by ``abs_requests`` requests *and* by a
factor ``rel``) are left out before the policy chooses.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.api.blocks import blocks_needed
from router.placement.balance import Balance
from router.workers.pool import WorkerHandle

__all__ = ["Balance", "with_room", "choose_decode"]


def with_room(handles: Sequence[WorkerHandle], tokens: int, max_tokens: int) -> list[WorkerHandle]:
    """The workers with free KV for ``tokens + max_tokens`` now; if none has, those whose
    whole cache could hold it. Empty: it fits nowhere."""
    fitting = [h for h in handles
               if h.load.free_blocks >= blocks_needed(tokens, max_tokens, h.info.block_size)]
    return fitting or [h for h in handles if h.info.kv_capacity_blocks
                       >= blocks_needed(tokens, max_tokens, h.info.block_size)]


def choose_decode(handles: Sequence[WorkerHandle], tokens: int, max_tokens: int) -> WorkerHandle | None:
    """The decode worker for a request of ``tokens`` (prompt + tokens already produced) that
    may generate ``max_tokens`` more (see the module docstring)."""
    options = with_room(handles, tokens, max_tokens)
    if not options:
        return None
    return min(options, key=lambda h: (h.load.load, -h.load.free_blocks, h.worker_id))
