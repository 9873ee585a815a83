"""The engine's side of the kvstore connector: the small Protocol the scheduler calls.

The scheduler calls an optional connector at two points of a request's life, always on the
engine thread, and nothing else does:

1. Admission (before the request's first compute, and again after a preemption). After the
   device prefix cache has supplied ``num_device_hit_tokens``, the scheduler asks
   :meth:`get_num_external_hits` how many *further* tokens the store can supply. It allocates
   blocks for them and calls :meth:`load` with those block ids; the connector copies the
   store's blocks in, verifies each, and returns how many *leading* blocks it loaded. Those
   become cached device blocks (``stored`` events); anything it did not load is computed.
2. After each step, every full block that the step completed and that did not come from the
   store is offered once to :meth:`save` (device-hit blocks are offered at admission, since
   the store may have lost them). ``save`` must copy the bytes out of the cache before it
   returns: the engine may reuse the blocks right after.

When a request finishes or is aborted, :meth:`request_finished` lets the connector drop its
per-request state (the worker server waits for save acknowledgements separately).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from kvstore.keys import BlockKey

if TYPE_CHECKING:
    from engine.core.request import Request

__all__ = ["EngineConnector"]


@runtime_checkable
class EngineConnector(Protocol):
    """What the scheduler needs from a KV connector. See the module docstring."""

    def get_num_external_hits(self, req: Request, num_device_hit_tokens: int) -> int:
        """Tokens after the first ``num_device_hit_tokens`` of ``req`` that the store holds.

        A multiple of ``block_size`` (only full blocks are stored): the keys are
        ``req.block_keys[num_device_hit_tokens // block_size:]``. The scheduler caps the answer
        so at least the last initial token is computed. Side-effect free as far as the engine
        is concerned; a store that cannot be reached holds nothing (return 0, never raise).
        The scheduler asks only when the request's blocks without store hits are free, and
        keeps the answer while the request waits for room: once per admission, again after a
        preemption or when the request's device hits changed meanwhile.
        """
        ...

    def load(self, req: Request, block_ids: Sequence[int]) -> int:
        """Copy store blocks into ``block_ids``; return how many leading ones were loaded.

        ``block_ids`` are ``req``'s blocks starting at index
        ``req.num_computed_tokens // block_size``; their keys are
        ``req.block_keys[start:start + len(block_ids)]``. Only verified blocks may be written;
        a missing or corrupt block ends the run (it and the rest are recomputed).
        """
        ...

    def save(
        self, req: Request, block_ids: Sequence[int], keys: Sequence[BlockKey]
    ) -> None:
        """Save these full, computed blocks under ``keys``; copy them out before returning."""
        ...

    def request_finished(self, req: Request) -> None:
        """``req`` finished or was aborted; its blocks are about to be freed."""
        ...
