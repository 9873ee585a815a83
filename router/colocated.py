"""The colocated orchestrator: each request runs whole (``phase: "full"``) on one worker.

The rollback path and the baseline of every benchmark. The worker is chosen among
decode-capable workers of the model that have room for ``prompt + max_tokens``, by the prefill
policy (so ``kv-aware`` still sends a repeated prefix where it is cached). A worker that fails
before the first token is replaced once by another; after the first token the error reaches
the client (resuming mid-stream is the disaggregated orchestrator's job).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import aclosing

from engine.api_types import GenerateChunk, GenerateFinal, GenerateRequest
from router.metrics import RouterMetrics
from router.openai_types import ServiceUnavailable
from router.policy import PrefillPolicy, blocks_needed, choose_decode
from router.serving import ServeRequest
from router.worker_client import WorkerUnavailable
from router.worker_pool import WorkerHandle, WorkerPool

__all__ = ["ColocatedOrchestrator"]


class ColocatedOrchestrator:
    """Implements :class:`router.serving.Orchestrator` over a :class:`WorkerPool`."""

    def __init__(self, pool: WorkerPool, policy: PrefillPolicy, metrics: RouterMetrics,
                 *, attempts: int = 2) -> None:
        self._pool, self._policy, self._metrics = pool, policy, metrics
        self._attempts = attempts
        self._aborts: set[asyncio.Task[bool]] = set()

    def _abort_detached(self, handle: WorkerHandle, request_id: str) -> None:
        """Abort in a task of its own: the caller may be in a cancelled scope (a client that
        disconnected), where an ``await`` in ``finally`` would be cancelled before it ran."""
        task = asyncio.get_running_loop().create_task(handle.client.abort(request_id))
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)

    def _choose(self, request: ServeRequest, exclude: set[str]) -> WorkerHandle:
        handles = [h for h in self._pool.decode_workers(request.model) if h.worker_id not in exclude]
        if not handles:
            raise ServiceUnavailable(f"no worker serves model {request.model!r} right now")
        n, max_tokens = len(request.prompt_token_ids), request.sampling.max_tokens
        fitting = [h for h in handles if choose_decode([h.load], n, max_tokens) is not None]
        if not fitting:
            raise ServiceUnavailable(
                f"no worker has KV room for {n} prompt + {max_tokens} output tokens; retry later")
        start = time.perf_counter()
        info = fitting[0].info
        keys = request.block_keys(info.namespace, info.block_size)
        chosen = self._policy.choose([h.load for h in fitting], keys, n)
        assert chosen is not None
        handle = next(h for h in fitting if h.load is chosen[0])
        self._metrics.record_decision(handle.worker_id, "full", time.perf_counter() - start)
        return handle

    async def serve(self, request: ServeRequest) -> AsyncIterator[GenerateChunk | GenerateFinal]:
        tried: set[str] = set()
        self._metrics.route_kind.labels("colocated").inc()
        while True:
            handle = self._choose(request, tried)
            tried.add(handle.worker_id)
            n = len(request.prompt_token_ids)
            booking = handle.load.assign(
                prefill_tokens=n,
                blocks=blocks_needed(n, request.sampling.max_tokens, handle.info.block_size))
            gen = GenerateRequest(request.request_id, request.prompt_token_ids, request.sampling,
                                  cache_salt=request.cache_salt, phase="full")
            started = finished = False
            try:
                async with aclosing(handle.client.generate(gen)) as stream:
                    async for item in stream:
                        if isinstance(item, GenerateFinal):
                            finished = True
                            handle.load.observe_stats(item.stats)
                            self._metrics.observe_worker_stats(item.stats)
                        elif not started:
                            started = True
                            booking.prefill_done()
                        yield item
                return
            except WorkerUnavailable:
                if started or len(tried) >= self._attempts:
                    raise
            finally:
                booking.release()
                if not finished:
                    self._abort_detached(handle, request.request_id)
