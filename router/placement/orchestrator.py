"""The serving path for one choice: where it prefills, where it decodes, what it left behind.

Implements ``router.placement.serving.Serving`` (the app owns text: it tokenizes, detokenizes
and applies stop strings; this module owns placement). For each ``ServeRequest``:

1. Plan (``_plan``): the prompt's block keys under the workers' published namespace, salted
   by ``cache_salt`` (computed once, kept on the request); the store's leading hits
   (``store_prefix``, asked only when a decision uses it); then the :class:`Route`:

   - mode ``disaggregated``: the prefill worker with the policy's best estimate
     (``router.placement.prefill``; ``kv-aware``: the lowest estimated time to first token
     from device hits, store hits and queued work);
   - mode ``colocated``: of the workers with room (``router.placement.decode.with_room``)
     and not loaded far past the least loaded (``Balance``), the one the prefill policy
     prefers runs ``phase="full"``;
   - mode ``auto``: when the would-be decode worker's (``choose_decode``) uncached part is
     shorter than ``auto_threshold`` tokens it prefills locally (``auto-local``), otherwise
     ``auto-remote`` (disaggregated). No prefill worker at all also means local.
   - the store down (``store_up()`` False, or this request's lookup failed): a request that
     would go through it (``disaggregated`` or ``auto-remote``) is served where it decodes,
     ``phase="full"`` on the decode choice, and says so: route ``store-down``. A prefill
     worker could not hand its KV over; the decode worker would compute the prompt again.
2. Run (``serve``): one loop over worker phases; :class:`~router.placement.failover.ChoiceRun`
   decides each next phase (the decode worker, a prefill retry, a resume) and keeps the
   books. The worker's chunks are yielded from this generator itself, so a token passes
   through two generator frames in placement: the worker client's stream and this one.
3. Yield ``GenerateChunk`` s (each output id once, in order, across failovers) and one
   ``GenerateFinal``: its token and latency figures are the first successful phase's (how
   the prompt was served; a later decode phase loads the same prompt again), its KV bytes
   and store seconds the sum over the phases (``failover.request_stats``; serving.py says why).

Errors are domain errors (``router.placement.errors``, ``router.workers.client``): the HTTP
layer maps them to statuses.

One ``RequestRecord`` per choice goes to the ``RequestLog`` however the choice ends: ``status``
``ok``; ``closed`` when the caller stopped reading early (a stop string matched, or the client
went away: the app knows which); ``error`` with the message.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from contextlib import aclosing

from prometheus_client import Counter

from engine.api.generate import GenerateChunk, GenerateFinal, Phase, WorkerInfo
from kvstore.errors import KVStoreError
from kvstore.keys import BlockKey
from router.metrics import RouterMetrics
from router.placement.decode import Balance, choose_decode, with_room
from router.placement.errors import NoCapacity, PlacementError
from router.placement.failover import ChoiceRun, FailoverKind, RunHooks
from router.placement.prefill import PrefillPolicy, prefer_local
from router.placement.request_log import RequestLog, RequestRecord
from router.placement.route import MODES, Mode, Plan, Route
from router.placement.serving import ServeRequest
from router.workers.client import WorkerError, WorkerRejected, WorkerUnavailable
from router.workers.pool import WorkerHandle, WorkerPool

__all__ = ["Orchestrator", "StorePrefixFn"]

log = logging.getLogger(__name__)

StorePrefixFn = Callable[[Sequence[bytes]], int]
"""Leading blocks of these keys the store holds (``kvstore`` client ``prefix_len``)."""
StoreUpFn = Callable[[], bool | None]
"""Whether the store is up (``router.workers.store.StoreView.up``; None: not known yet)."""


class Orchestrator:
    """See the module docstring. ``store_prefix(keys)`` is blocking (a ``kvstore`` client's
    ``prefix_len``); it runs on a thread, and a store error counts as "no hit".
    ``store_up()`` says whether the store is up; without it the store is taken to be up."""

    max_prefill_retries = 1
    max_resumes = 2

    def __init__(self, pool: WorkerPool, policy: PrefillPolicy, metrics: RouterMetrics, *,
                 mode: Mode = "disaggregated", auto_threshold: int = 256,
                 balance: Balance = Balance(),
                 store_prefix: StorePrefixFn | None = None, store_up: StoreUpFn | None = None,
                 request_log: RequestLog | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if auto_threshold < 0:
            raise ValueError(f"auto_threshold must be >= 0, got {auto_threshold}")
        self.pool, self.policy, self.metrics = pool, policy, metrics
        self.mode, self.auto_threshold, self.balance = mode, auto_threshold, balance
        self.store_prefix, self.store_up = store_prefix, store_up
        self.request_log = request_log or RequestLog()
        self.failovers = Counter("kvrouter_failovers",
                                 "Prefill retries and decode resumes after a worker failure",
                                 ["kind"], registry=metrics.registry)
        for kind in ("prefill_retry", "decode_resume"):
            self.failovers.labels(kind)
        self._hooks = RunHooks(on_phase=self._on_phase, on_failover=self._on_failover,
                               on_route=self._on_route)

    # --- the serving path ---------------------------------------------------------------
    async def serve(self, request: ServeRequest) -> AsyncGenerator[GenerateChunk | GenerateFinal, None]:
        record = RequestRecord(request.request_id, prompt_tokens=len(request.prompt_token_ids))
        run: ChoiceRun | None = None
        finished = False
        try:
            plan = await self._plan(request)
            record.mode = plan.route
            run = ChoiceRun(request, plan, lambda phase: self._candidates(request.model, phase),
                            record, self._hooks, self.max_prefill_retries, self.max_resumes)
            while (phase := run.next_phase()) is not None:
                try:
                    async with aclosing(phase.worker.client.generate(phase.request)) as items:
                        async for item in items:
                            if isinstance(item, GenerateFinal):
                                run.finished(phase, item)
                                break
                            if (chunk := run.chunk(phase, item)) is not None:
                                record.mark("first_token")
                                yield chunk
                        else:
                            raise WorkerUnavailable(phase.worker.worker_id,
                                                    "stream ended without a final line")
                except WorkerRejected:
                    run.rejected(phase)
                    raise
                except WorkerUnavailable as exc:
                    run.failed(phase, exc)
            final = run.final()
            record.finish_reason = final.finish_reason
            finished = True
            yield final
        except (PlacementError, WorkerError) as exc:
            record.status, record.error = "error", str(exc)
            raise
        except Exception as exc:
            record.status, record.error = "error", repr(exc)
            raise
        finally:
            if run is not None:
                run.close()
            if not finished and record.status == "ok":
                record.status = "closed"
            record.output_tokens = len(run.sent) if run is not None else 0
            record.mark("end")
            self.request_log.emit(record)

    # --- planning -----------------------------------------------------------------------
    def _candidates(self, model: str, phase: Phase) -> list[WorkerHandle]:
        """Workers of ``model`` for ``phase`` (``prefill``, else decode-capable), restricted
        to one KV layout (namespace, block size) so block keys mean the same on all."""
        handles = (self.pool.prefill_workers(model) if phase == "prefill"
                   else self.pool.decode_workers(model))
        if not handles:
            return []
        ref = self.pool.models().get(model) or handles[0].info
        return [h for h in handles if h.info.namespace == ref.namespace
                and h.info.block_size == ref.block_size]

    async def _store_blocks(self, keys: Sequence[BlockKey]) -> int | None:
        """The store's leading hits; None when the lookup failed (the store is down)."""
        if self.store_prefix is None or not keys:
            return 0
        try:
            return await asyncio.to_thread(self.store_prefix, keys)
        except (KVStoreError, OSError) as exc:
            log.info("store prefix lookup failed (%s); routing as if the store held nothing", exc)
            return None

    async def _plan(self, request: ServeRequest) -> Plan:
        decode = self._candidates(request.model, "decode")
        if not decode:
            raise NoCapacity(f"no decode-capable worker serves {request.model!r} now; "
                             "start one (`kvengine serve --role decode|colocated`)")
        info: WorkerInfo = decode[0].info
        keys = request.block_keys(info.namespace, info.block_size)
        needs_store = self.policy.name == "kv-aware" or self.mode == "auto"
        looked_up = await self._store_blocks(keys) if needs_store else 0
        store_down = looked_up is None or (self.store_up is not None and self.store_up() is False)
        store_blocks = looked_up or 0
        n, max_tokens = len(request.prompt_token_ids), request.sampling.max_tokens
        start = time.perf_counter()

        if self.mode == "colocated":
            fitting = self.balance.within(with_room(decode, n, max_tokens))
            chosen = self.policy.choose([w.load for w in fitting], keys, n, store_blocks)
            if chosen is None:
                raise NoCapacity(f"no worker's KV cache can hold {n} prompt + "
                                 f"{max_tokens} output tokens")
            return self._decided(fitting, chosen[0].worker_id, chosen[1].uncached_tokens,
                                 Route.COLOCATED, start)

        prefill = self._candidates(request.model, "prefill")
        if self.mode == "auto":
            dec = choose_decode(decode, n, max_tokens)
            if dec is not None:
                local = self.policy.choose([dec.load], keys, n, store_blocks)
                assert local is not None
                if prefer_local(local[1], self.auto_threshold) or not prefill:
                    return self._decided(decode, dec.worker_id, local[1].uncached_tokens,
                                         Route.AUTO_LOCAL, start)
        if store_down:
            dec = choose_decode(decode, n, max_tokens)
            if dec is None:
                raise NoCapacity(f"no decode worker's KV cache can hold {n} prompt + "
                                 f"{max_tokens} output tokens")
            local = self.policy.choose([dec.load], keys, n, 0)
            assert local is not None
            return self._decided(decode, dec.worker_id, local[1].uncached_tokens,
                                 Route.STORE_DOWN, start)
        if not prefill:
            raise NoCapacity(f"no prefill worker serves {request.model!r} now; start one "
                             "(`kvengine serve --role prefill`) or use --mode auto")
        chosen = self.policy.choose([w.load for w in prefill], keys, n, store_blocks)
        assert chosen is not None
        route = Route.AUTO_REMOTE if self.mode == "auto" else Route.DISAGGREGATED
        return self._decided(prefill, chosen[0].worker_id, chosen[1].uncached_tokens, route, start)

    def _decided(self, handles: Sequence[WorkerHandle], worker_id: str, uncached: int,
                 route: Route, start: float) -> Plan:
        self.metrics.decision_time.observe(time.perf_counter() - start)
        self.metrics.route_kind.labels(route.value).inc()
        first = next(h for h in handles if h.worker_id == worker_id)
        return Plan(route, first, uncached)

    # --- metrics hooks ------------------------------------------------------------------
    def _on_route(self, worker_id: str, phase: Phase) -> None:
        self.metrics.record_decision(worker_id, phase)

    def _on_phase(self, worker_id: str, phase: Phase, final: GenerateFinal) -> None:
        self.metrics.observe_worker_stats(final.stats)

    def _on_failover(self, kind: FailoverKind) -> None:
        self.failovers.labels(kind).inc()
