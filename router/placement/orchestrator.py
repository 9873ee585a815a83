"""The serving path for one choice: where it prefills, where it decodes, what it left behind.

Implements ``router.placement.serving.Orchestrator`` (the app owns text: it tokenizes, detokenizes and
applies stop strings; this module owns placement). For each ``ServeRequest``:

1. Plan (``_plan``): the prompt's block keys under the workers' published namespace, salted
   by ``cache_salt`` (computed once, kept on the request); the store's leading hits
   (``store_prefix``, asked only when a decision uses it); then the mode:

   - ``disaggregated``: the prefill worker with the policy's best estimate (``kv-aware``: the
     lowest estimated time to first token from device hits, store hits and queued work);
   - ``colocated``: one decode-capable worker, chosen the same way, runs ``phase="full"``;
   - ``auto``: when the would-be decode worker's uncached part is shorter than
     ``auto_threshold`` tokens it prefills locally (``phase="full"``, counted as ``local``),
     otherwise disaggregated. No prefill worker at all also means local.
2. Run (``router.placement.failover.ChoiceRun``): prefill (retried once elsewhere), then decode on the
   least-loaded worker with free KV for prompt + ``max_tokens`` (when none has, the
   least-loaded one whose cache could hold it: the request queues there instead of failing
   while the fleet is busy), resumed on another decode worker if one dies mid-stream; every
   worker still holding the request is aborted when the stream ends early.
3. Yield ``GenerateChunk`` s (each output id once, in order, across failovers) and one
   ``GenerateFinal``: its token and latency figures are the first successful phase's (how
   the prompt was served; a later decode phase loads the same prompt again), its KV bytes
   and store seconds the sum over the phases (``_request_stats``; router/placement/serving.py says why).

Errors before the first token are ``OpenAIError`` s (``ServiceUnavailable`` when no worker can
serve; ``BadRequest`` when a worker refuses the request as malformed).

One ``RequestRecord`` per choice goes to the ``RequestLog`` however the choice ends: ``status``
``ok``; ``closed`` when the caller stopped reading early (a stop string matched, or the client
went away: the app knows which); ``error`` with the message.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing

from prometheus_client import Counter

from engine.api.generate import GenerateChunk, GenerateFinal, RequestStats, WorkerInfo
from kvstore.errors import KVStoreError
from kvstore.keys import BlockKey
from router.config import MODES, Mode
from router.placement.failover import ChoiceRun, Plan, RunHooks, pick_decode, with_room
from router.metrics import RouterMetrics
from router.http.openai_types import OpenAIError, ServiceUnavailable
from router.placement.policy import PrefillPolicy, StorePrefixFn, prefer_local
from router.request_log import RequestLog, RequestRecord
from router.placement.serving import ServeRequest
from router.workers.pool import WorkerHandle, WorkerPool

__all__ = ["Orchestrator"]

log = logging.getLogger(__name__)

_STAT_FIELDS = tuple(RequestStats().to_json())


class Orchestrator:
    """See the module docstring. ``store_prefix(keys)`` is blocking (a ``kvstore`` client's
    ``prefix_len``); it runs on a thread, and a store error counts as "no hit"."""

    max_prefill_retries = 1
    max_resumes = 2

    def __init__(self, pool: WorkerPool, policy: PrefillPolicy, metrics: RouterMetrics, *,
                 mode: Mode = "disaggregated", auto_threshold: int = 256,
                 store_prefix: StorePrefixFn | None = None,
                 request_log: RequestLog | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if auto_threshold < 0:
            raise ValueError(f"auto_threshold must be >= 0, got {auto_threshold}")
        self.pool, self.policy, self.metrics = pool, policy, metrics
        self.mode, self.auto_threshold = mode, auto_threshold
        self.store_prefix = store_prefix
        self.request_log = request_log or RequestLog()
        self.failovers = Counter("kvrouter_failovers",
                                 "Prefill retries and decode resumes after a worker failure",
                                 ["kind"], registry=metrics.registry)
        for kind in ("prefill_retry", "decode_resume"):
            self.failovers.labels(kind)
        self._hooks = RunHooks(on_phase=self._on_phase, on_failover=self._on_failover,
                               on_route=self._on_route)

    # --- the serving path ---------------------------------------------------------------
    async def serve(self, request: ServeRequest) -> AsyncIterator[GenerateChunk | GenerateFinal]:
        record = RequestRecord(request.request_id, prompt_tokens=len(request.prompt_token_ids))
        n_out = 0
        finished = False
        try:
            plan = await self._plan(request, record)
            record.mode = plan.mode_label
            run = ChoiceRun(request.request_id, request.prompt_token_ids, request.sampling,
                            request.cache_salt, plan,
                            lambda phase: self._candidates(request.model, phase), record,
                            self._hooks, self.max_prefill_retries, self.max_resumes)
            async with aclosing(run.tokens()) as tokens:
                async for chunk in tokens:
                    record.mark("first_token")
                    n_out += len(chunk.token_ids)
                    yield chunk
            record.finish_reason = run.finish_reason or "length"
            finished = True
            yield GenerateFinal(record.finish_reason, _request_stats(record))  # type: ignore[arg-type]
        except OpenAIError as exc:
            record.status, record.error = "error", str(exc)
            raise
        except Exception as exc:
            record.status, record.error = "error", repr(exc)
            raise
        finally:
            if not finished and record.status == "ok":
                record.status = "closed"
            record.output_tokens = n_out
            record.mark("end")
            self.request_log.emit(record)

    # --- planning -----------------------------------------------------------------------
    def _candidates(self, model: str, phase: str) -> list[WorkerHandle]:
        """Workers of ``model`` for ``phase`` (``prefill``, else decode-capable), restricted
        to one KV layout (namespace, block size) so block keys mean the same on all."""
        handles = (self.pool.prefill_workers(model) if phase == "prefill"
                   else self.pool.decode_workers(model))
        if not handles:
            return []
        ref = self.pool.models().get(model) or handles[0].info
        return [h for h in handles if h.info.namespace == ref.namespace
                and h.info.block_size == ref.block_size]

    async def _store_blocks(self, keys: Sequence[BlockKey]) -> int:
        if self.store_prefix is None or not keys:
            return 0
        try:
            return await asyncio.to_thread(self.store_prefix, keys)
        except (KVStoreError, OSError) as exc:
            log.info("store prefix lookup failed (%s); routing as if the store held nothing", exc)
            return 0

    async def _plan(self, request: ServeRequest, record: RequestRecord) -> Plan:
        decode = self._candidates(request.model, "decode")
        if not decode:
            raise ServiceUnavailable(f"no decode-capable worker serves {request.model!r} now; "
                                     "start one (`kvengine serve --role decode|colocated`)")
        info: WorkerInfo = decode[0].info
        keys = request.block_keys(info.namespace, info.block_size)
        needs_store = self.policy.name == "kv-aware" or self.mode == "auto"
        store_blocks = await self._store_blocks(keys) if needs_store else 0
        n, max_tokens = len(request.prompt_token_ids), request.sampling.max_tokens
        start = time.perf_counter()

        if self.mode == "colocated":
            fitting = with_room(decode, n, max_tokens)
            chosen = self.policy.choose([w.load for w in fitting], keys, n, store_blocks)
            if chosen is None:
                raise ServiceUnavailable(f"no worker's KV cache can hold {n} prompt + "
                                         f"{max_tokens} output tokens")
            return self._decided(fitting, chosen[0].worker_id, "full", chosen[1].uncached_tokens,
                                 "colocated", start)

        prefill = self._candidates(request.model, "prefill")
        if self.mode == "auto":
            dec = pick_decode(decode, n, max_tokens)
            if dec is not None:
                est = self.policy.estimates([dec.load], keys, n, store_blocks)[0]
                if prefer_local(est, self.auto_threshold) or not prefill:
                    return self._decided(decode, dec.worker_id, "full", est.uncached_tokens,
                                         "auto-local", start)
        if not prefill:
            raise ServiceUnavailable(f"no prefill worker serves {request.model!r} now; start one "
                                     "(`kvengine serve --role prefill`) or use --mode auto")
        chosen = self.policy.choose([w.load for w in prefill], keys, n, store_blocks)
        assert chosen is not None
        label = "auto-remote" if self.mode == "auto" else "disaggregated"
        return self._decided(prefill, chosen[0].worker_id, "prefill", chosen[1].uncached_tokens,
                             label, start)

    def _decided(self, handles: Sequence[WorkerHandle], worker_id: str, phase: str,
                 uncached: int, label: str, start: float) -> Plan:
        self.metrics.decision_time.observe(time.perf_counter() - start)
        self.metrics.route_kind.labels(
            {"colocated": "colocated", "auto-local": "local"}.get(label, "disaggregated")).inc()
        first = next(h for h in handles if h.worker_id == worker_id)
        return Plan("full" if phase == "full" else "disaggregated", first, uncached, label)

    # --- metrics hooks ------------------------------------------------------------------
    def _on_route(self, worker_id: str, phase: str) -> None:
        self.metrics.record_decision(worker_id, phase)

    def _on_phase(self, worker_id: str, phase: str, final: GenerateFinal) -> None:
        self.metrics.observe_worker_stats(final.stats)

    def _on_failover(self, kind: str) -> None:
        self.failovers.labels(kind).inc()


_PROMPT_FIELDS = ("computed_prompt_tokens", "device_hit_tokens", "store_hit_tokens",
                  "queue_s", "prefill_s", "first_token_s")


def _request_stats(record: RequestRecord) -> RequestStats:
    """The request's stats for the client (``usage.prompt_tokens_details.cached_tokens``):
    how its prompt was served is the first successful phase's figures (a decode phase loads
    the same prompt again; counting it twice would report more cached tokens than the prompt
    has); KV bytes and store seconds are summed over every phase."""
    done = [p.stats for p in record.phases if p.ok]
    total: dict[str, float] = dict.fromkeys(_STAT_FIELDS, 0)
    for stats in done:
        for name in _STAT_FIELDS:
            if name not in _PROMPT_FIELDS:
                total[name] += stats.get(name, 0)
    if done:
        total.update({name: done[0].get(name, 0) for name in _PROMPT_FIELDS})
    return RequestStats(**total)  # type: ignore[arg-type]
