"""The contract between the HTTP app and whatever moves a request through the workers.

The app (``router/http/app.py``) owns text: it tokenizes, applies the chat template, detokenizes
and applies stop strings. Whatever implements :class:`Serving` (``router.placement.
orchestrator.Orchestrator``) owns placement: it picks workers, sends them
:class:`GenerateRequest` s, and yields the token stream of one choice::

    async for item in serving.serve(request):   # GenerateChunk ..., then GenerateFinal
        ...

Contract of ``serve``:
- Yields :class:`GenerateChunk` s (the output ids, in order, each exactly once, even across a
  failover) and ends with exactly one :class:`GenerateFinal` whose ``stats`` describe the
  request, not one worker: its token and latency figures (computed / device-hit / store-hit
  prompt tokens, queue, prefill and first-token seconds) are the first successful phase's,
  because that phase is how the prompt was served (a decode phase after it loads the same
  prompt again; summing would count the prompt twice, and ``usage``'s cached tokens could
  exceed the prompt); its KV bytes and store seconds are summed over every phase, because
  each phase moved its own.
- Raises domain errors, never HTTP ones: :class:`~router.placement.errors.NoCapacity` when no
  worker can serve the request (before the first token, or when every worker that could
  continue it has failed), ``router.workers.client.WorkerRejected`` when a worker refuses
  it (its subclass ``KeyMismatch``: prefill and decode workers disagree on block keys).
  ``router.http.errors`` maps them to statuses and OpenAI bodies.
- If the caller stops iterating early (a stop string matched, the client disconnected) it
  closes the generator (``aclose``); the orchestrator's ``finally`` then aborts the request on
  every worker that holds it, so its KV is freed.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Protocol

from engine.api.generate import GenerateChunk, GenerateFinal, SamplingParams
from kvstore.keys import BlockKey, block_keys, salted

__all__ = ["ServeRequest", "Serving"]


@dataclass(slots=True)
class ServeRequest:
    """One choice of one client request, tokenized. ``request_id`` is unique per choice and
    is the id every worker sees (``<client id>-<choice>``)."""

    request_id: str
    model: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    cache_salt: str | None = None
    _keys: dict[tuple[bytes, int], list[BlockKey]] = field(default_factory=dict, repr=False)

    def block_keys(self, namespace: bytes, block_size: int) -> list[BlockKey]:
        """The prompt's full-block keys under ``namespace`` (salted by ``cache_salt``);
        computed once per (namespace, block size) and kept with the request."""
        cache_key = (bytes(namespace), block_size)
        keys = self._keys.get(cache_key)
        if keys is None:
            keys = block_keys(salted(namespace, self.cache_salt), self.prompt_token_ids, block_size)
            self._keys[cache_key] = keys
        return keys


class Serving(Protocol):
    """What the app needs of placement: one choice's token stream."""

    def serve(self, request: ServeRequest) -> AsyncGenerator[GenerateChunk | GenerateFinal, None]:
        """Run one choice; see the module docstring for the contract."""
        ...
