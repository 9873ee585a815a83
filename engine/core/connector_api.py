"""The engine's side of the kvstore connector: the small Protocol the scheduler calls.

The scheduler calls an optional connector, always on the engine thread; the connector does its
store I/O on threads of its own, so no running request waits for another's KV.

1. A request arrives: :meth:`lookup_ahead` may start finding out what the store holds for it.
2. Admission. After the device prefix cache supplied ``num_device_hit_tokens``, the scheduler
   asks :meth:`get_num_external_hits` how many *further* tokens the store holds. ``None`` means
   the answer is not in yet (the lookup crosses the network off the engine thread): the
   request is passed over and asked about again at the next step. With hits, the scheduler
   allocates their blocks, parks the request (``WAITING_FOR_KV``) and calls
   :meth:`start_load`; the running batch keeps stepping.
3. Every step begins with :meth:`finished_loads`: each load ends there exactly once, with how
   many *leading* blocks it verified into the cache. Those become cached device blocks
   (``stored`` events); the rest are computed. The request joins the batch at that step. A load
   that outlives the scheduler's deadline is abandoned: its blocks stay allocated until it
   reports (so the loader never writes a block someone else holds), and the request computes.
4. After each step, every full block that the step completed and that did not come from the
   store is offered once to :meth:`save` (device-hit blocks are offered at admission, since the
   store may have lost them). ``save`` must copy the bytes out of the cache before it returns:
   the engine may reuse the blocks right after.
5. :meth:`request_finished` when a request finishes or is aborted (its in-flight load, if
   any, still reports through ``finished_loads``).

:meth:`wait` lets an engine with nothing to compute sleep until a lookup or a load ends.
What the connector does for a request (save it, hand it off, load from where) is on the
request (``Request.kv``); what its loads brought is added there by the scheduler.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from kvstore.keys import BlockKey

if TYPE_CHECKING:
    from engine.core.request import LoadTally, Request

__all__ = ["EngineConnector", "LoadDone"]


@dataclass(frozen=True, slots=True)
class LoadDone:
    """A load that ended: ``tally.loaded`` leading blocks of request ``request_id`` are in the
    cache, verified."""

    request_id: str
    tally: LoadTally


@runtime_checkable
class EngineConnector(Protocol):
    """What the scheduler needs from a KV connector. See the module docstring."""

    def lookup_ahead(self, req: Request) -> None:
        """``req`` arrived: start finding out what the store holds for it (never blocks)."""
        ...

    def get_num_external_hits(self, req: Request, num_device_hit_tokens: int) -> int | None:
        """Tokens after the first ``num_device_hit_tokens`` of ``req`` that the store holds, or
        None while the answer is not in (ask again next step).

        A multiple of ``block_size`` (only full blocks are stored): the keys are
        ``req.block_keys[num_device_hit_tokens // block_size:]``. The scheduler caps the answer
        so at least the last initial token is computed. A store that cannot be reached holds
        nothing (return 0, never raise). The scheduler asks only when the request's blocks
        without store hits are free, and keeps the answer while the request waits for room.
        """
        ...

    def start_load(self, req: Request, block_ids: Sequence[int]) -> None:
        """Start copying store blocks into ``block_ids`` (never blocks); it ends in
        :meth:`finished_loads`.

        ``block_ids`` are ``req``'s blocks starting at index
        ``req.num_computed_tokens // block_size``; their keys are
        ``req.block_keys[start:start + len(block_ids)]``. Only verified blocks may be written;
        a missing or corrupt block ends the run (it and the rest are recomputed).
        """
        ...

    def finished_loads(self) -> list[LoadDone]:
        """The loads that ended since the last call, each once."""
        ...

    def wait(self, timeout: float) -> None:
        """Return when a lookup or a load ended since the last :meth:`finished_loads`, or after
        ``timeout`` seconds."""
        ...

    def save(
        self, req: Request, block_ids: Sequence[int], keys: Sequence[BlockKey], held: bool = False
    ) -> None:
        """Save these full, computed blocks under ``keys``; copy them out before returning.
        ``held``: they were device hits, which the store usually holds (put only what it lost)."""
        ...

    def request_finished(self, req: Request) -> None:
        """``req`` finished or was aborted; its blocks are about to be freed."""
        ...
