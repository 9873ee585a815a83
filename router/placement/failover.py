"""One choice's token stream across workers: prefill (retried once), then decode (resumed).

``ChoiceRun.tokens()`` yields the output token chunks of one choice, in order, whatever
happens to the workers underneath. The plan (``Plan``) says where it starts:

- ``"disaggregated"``: ``phase="prefill"`` on ``plan.prefill`` gives the first token and the
  prompt's block keys once every full prompt block is in the store; then ``phase="decode"`` on
  a decode worker with ``output_token_ids=[first]`` and those ``block_keys`` (the decode worker
  refuses them with 409 if its own keys differ) streams the rest.
- ``"full"``: one worker prefills and decodes (colocated mode, or ``auto`` mode's local path).

Failures (``WorkerUnavailable``: unreachable, 5xx, a broken stream):

- A prefill that fails is retried once on another prefill worker (``prefill_retries``); a
  ``"full"`` run that fails before its first token likewise.
- A stream that breaks after tokens were sent resumes on another decode-capable worker with
  ``phase="decode"`` and ``output_token_ids`` = every token sent so far: that worker loads the
  prompt's full blocks from the store, recomputes the rest, and continues. Sampling
  randomness is a function of ``(seed, position)``, so greedy and seeded requests continue
  exactly as an uninterrupted run would. At most ``max_resumes`` times.
- ``WorkerRejected`` (4xx) is not retried: the request itself is wrong (400), or, for a 409,
  the prefill and decode workers disagree on the prompt's block keys (a deployment fault:
  answered as a 500 naming it).

Whatever ends the stream early (the consumer stops at a stop string, the client disconnects,
an error), every worker still holding the request is told ``/abort`` (in the background, so
a cancelled task still sends it). The worker bookkeeping the policies read (``Assignment``)
is released in every case. Each phase's final stats go to the ``RequestRecord``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Literal

from engine.api.generate import GenerateChunk, GenerateFinal, GenerateRequest, SamplingParams
from router.http.openai_types import BadRequest, OpenAIError, ServiceUnavailable
from router.placement.policy import Assignment, blocks_needed, choose_decode
from router.request_log import PhaseStats, RequestRecord
from router.workers.client import WorkerRejected, WorkerUnavailable
from router.workers.pool import WorkerHandle

__all__ = ["Plan", "ChoiceRun", "RunHooks", "pick_decode", "with_room"]

log = logging.getLogger(__name__)

# Background abort tasks: held here so they are not garbage-collected before they run.
_background: set[asyncio.Task[None]] = set()


def with_room(handles: Sequence[WorkerHandle], tokens: int, max_tokens: int) -> list[WorkerHandle]:
    """The workers with free KV for ``tokens + max_tokens`` now; if none has, those whose
    whole cache could hold it (the request waits in that worker's queue, as it would in a
    single engine, rather than failing while the fleet is busy). Empty: it fits nowhere."""
    fitting = [h for h in handles
               if h.load.free_blocks >= blocks_needed(tokens, max_tokens, h.info.block_size)]
    return fitting or [h for h in handles if h.info.kv_capacity_blocks
                       >= blocks_needed(tokens, max_tokens, h.info.block_size)]


def pick_decode(handles: Sequence[WorkerHandle], tokens: int, max_tokens: int) -> WorkerHandle | None:
    """The decode worker: enough free KV blocks first, then the least loaded (``with_room``)."""
    options = with_room(handles, tokens, max_tokens)
    if not options:
        return None
    by_id = {h.worker_id: h for h in options}
    loads = [h.load for h in options]
    chosen = choose_decode(loads, tokens, max_tokens) or min(
        loads, key=lambda w: (w.load, -w.free_blocks, w.worker_id))
    return by_id[chosen.worker_id]


@dataclass(slots=True)
class Plan:
    """Where a choice starts: ``kind``, the first worker, and the prefill estimate's token
    split (``uncached_tokens`` is what the first worker is expected to compute)."""

    kind: Literal["disaggregated", "full"]
    first: WorkerHandle
    uncached_tokens: int
    mode_label: str                      # for the log record: disaggregated | colocated | auto-*


@dataclass(slots=True)
class RunHooks:
    """Callbacks for metrics; all optional. ``on_phase(worker_id, phase, stats)`` after each
    worker phase ends; ``on_failover(kind)`` with ``"prefill_retry"`` or ``"decode_resume"``;
    ``on_route(worker_id, phase)`` when a worker is chosen for a phase."""

    on_phase: Callable[[str, str, GenerateFinal], None] | None = None
    on_failover: Callable[[str], None] | None = None
    on_route: Callable[[str, str], None] | None = None


@dataclass(eq=False)
class ChoiceRun:
    """The worker-facing half of one choice (see the module docstring)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    cache_salt: str | None
    plan: Plan
    candidates: Callable[[str], Sequence[WorkerHandle]]   # phase -> eligible workers now
    record: RequestRecord
    hooks: RunHooks = field(default_factory=RunHooks)
    max_prefill_retries: int = 1
    max_resumes: int = 2
    finish_reason: str | None = None
    sent: list[int] = field(default_factory=list)
    block_keys: list | None = None       # the prefill's prompt block keys, for the decode
    _live: dict[str, WorkerHandle] = field(default_factory=dict)
    _failed: set[str] = field(default_factory=set)

    # --- the stream ---------------------------------------------------------------------
    async def tokens(self) -> AsyncIterator[GenerateChunk]:
        """Output chunks in order; ``finish_reason`` is set once it ends normally."""
        try:
            phase = "full"
            if self.plan.kind == "disaggregated":
                async with aclosing(self._prefill()) as prefill:
                    async for chunk in prefill:
                        yield chunk
                if self.finish_reason is not None:
                    return
                phase = "decode"
            first = self.plan.first if phase == "full" else None
            async with aclosing(self._stream(phase, first)) as stream:
                async for chunk in stream:
                    yield chunk
        finally:
            self._abort_live()

    async def _prefill(self) -> AsyncIterator[GenerateChunk]:
        rec = self.record
        worker: WorkerHandle | None = self.plan.first
        errors: list[str] = []
        for attempt in range(self.max_prefill_retries + 1):
            if worker is None:
                break
            rec.prefill_worker = worker.worker_id
            rec.mark("prefill_start")
            got: list[GenerateChunk] = []
            try:
                final = await self._run_phase(worker, "prefill", self.plan.uncached_tokens, got)
            except WorkerUnavailable as exc:
                errors.append(str(exc))
                self._failed.add(worker.worker_id)
                rec.add_phase(PhaseStats(worker.worker_id, "prefill", ok=False, error=str(exc),
                                         output_tokens=sum(len(c.token_ids) for c in got)))
                log.warning("request %s: prefill on %s failed (%s)", self.request_id,
                            worker.worker_id, exc)
                if attempt < self.max_prefill_retries:
                    rec.prefill_retries += 1
                    self._failover("prefill_retry")
                worker = self._pick_prefill()
                continue
            rec.mark("prefill_end")
            self.block_keys = final.block_keys
            for chunk in got:
                self.sent.extend(chunk.token_ids)
                yield chunk
            if final.finish_reason == "stop" or len(self.sent) >= self.sampling.max_tokens:
                self.finish_reason = "stop" if final.finish_reason == "stop" else "length"
            return
        raise ServiceUnavailable(
            "no prefill worker could take the request"
            + (f": {'; '.join(errors)}" if errors else " (none is available)"))

    async def _stream(self, phase: str, worker: WorkerHandle | None) -> AsyncIterator[GenerateChunk]:
        rec = self.record
        resumes = 0
        retried = False
        while True:
            if worker is None:
                worker = self._pick_decode()
            if worker is None:
                raise ServiceUnavailable(
                    "no decode worker can hold the request's KV"
                    + (" to resume it" if self.sent else "")
                    + (f" (workers that failed it: {sorted(self._failed)})" if self._failed else ""))
            rec.decode_workers.append(worker.worker_id)
            # A "full" phase prefills where it decodes: no transfer, its first token ends
            # the prefill. A decode phase starts with the transfer (the store load).
            rec.mark("prefill_start" if phase == "full" else "transfer_start")
            before = len(self.sent)
            try:
                async with aclosing(self._phase_stream(worker, phase)) as chunks:
                    async for chunk in chunks:
                        rec.mark("prefill_end" if phase == "full" else "decode_first")
                        self.sent.extend(chunk.token_ids)
                        yield chunk
                return
            except WorkerUnavailable as exc:
                self._failed.add(worker.worker_id)
                rec.add_phase(PhaseStats(worker.worker_id, phase, ok=False, error=str(exc),
                                         output_tokens=len(self.sent) - before))
                log.warning("request %s: %s on %s failed after %d tokens (%s)", self.request_id,
                            phase, worker.worker_id, len(self.sent), exc)
                if phase == "full" and not self.sent and not retried:
                    retried = True                       # nothing sent yet: a plain retry
                    rec.prefill_retries += 1
                    self._failover("prefill_retry")
                else:
                    resumes += 1
                    if resumes > self.max_resumes:
                        raise ServiceUnavailable(
                            f"request {self.request_id}: gave up after {resumes - 1} resumes: {exc}"
                        ) from exc
                    rec.decode_resumes += 1
                    self._failover("decode_resume")
                    if self.sent:
                        phase = "decode"    # continue from the store's blocks + sent tokens
                worker = None

    # --- one worker phase ---------------------------------------------------------------
    async def _phase_stream(self, worker: WorkerHandle, phase: str) -> AsyncIterator[GenerateChunk]:
        """Stream one decode/full phase; sets ``finish_reason`` from its final line."""
        remaining = self.sampling.max_tokens - len(self.sent)
        if remaining <= 0:
            self.finish_reason = "length"
            return
        tokens = len(self.prompt_token_ids) + len(self.sent)
        books = worker.load.assign(
            prefill_tokens=self.plan.uncached_tokens if phase == "full" and not self.sent else 0,
            blocks=blocks_needed(tokens, remaining, worker.info.block_size))
        async with aclosing(self._phase(worker, phase, books)) as items:
            async for item in items:
                if isinstance(item, GenerateFinal):
                    self.finish_reason = item.finish_reason
                    self.record.mark("decode_end")
                elif item.token_ids:
                    yield item

    async def _run_phase(self, worker: WorkerHandle, phase: str, uncached: int,
                         out: list[GenerateChunk]) -> GenerateFinal:
        """Run a phase to its end, collecting its chunks (the prefill handoff)."""
        books = worker.load.assign(prefill_tokens=uncached,
                                   blocks=blocks_needed(len(self.prompt_token_ids), 1,
                                                        worker.info.block_size))
        async with aclosing(self._phase(worker, phase, books)) as items:
            async for item in items:
                if isinstance(item, GenerateFinal):
                    return item
                out.append(item)
        raise AssertionError("_phase ends with its final line or raises")

    async def _phase(self, worker: WorkerHandle, phase: str, books: Assignment
                     ) -> AsyncIterator[GenerateChunk | GenerateFinal]:
        """One phase on ``worker``: its chunks (the first ends the prefill in the books), then
        its final line, recorded (``_finish_phase``); ``books`` released however it ends."""
        request = GenerateRequest(self.request_id, self.prompt_token_ids, self.sampling,
                                  list(self.sent), self.cache_salt, phase,  # type: ignore[arg-type]
                                  block_keys=self.block_keys if phase == "decode" else None)
        self._route(worker, phase)
        produced = 0
        try:
            async with aclosing(self._generate(worker, request)) as items:
                async for item in items:
                    if isinstance(item, GenerateFinal):
                        self._finish_phase(worker, phase, item, books, produced)
                        yield item
                        return
                    books.prefill_done()
                    produced += len(item.token_ids)
                    yield item
        finally:
            books.release()
        raise WorkerUnavailable(worker.worker_id, "stream ended without a final line")

    async def _generate(self, worker: WorkerHandle, request: GenerateRequest
                        ) -> AsyncIterator[GenerateChunk | GenerateFinal]:
        """The worker's stream; while it runs the worker is *live* (aborted if we stop early)."""
        self._live[worker.worker_id] = worker
        try:
            async with aclosing(worker.client.generate(request)) as items:
                async for item in items:
                    yield item
        except WorkerRejected as exc:
            self._live.pop(worker.worker_id, None)
            if exc.status == 409:
                raise OpenAIError(f"the prefill and decode workers disagree on the prompt's "
                                  f"block keys: {exc}") from exc
            raise BadRequest(f"the worker refused the request: {exc}") from exc
        except WorkerUnavailable:
            self._abort_live(only=worker.worker_id)  # a 5xx from a live worker: free it there
            raise

    def _finish_phase(self, worker: WorkerHandle, phase: str, final: GenerateFinal,
                      books: Assignment, output_tokens: int) -> None:
        self._live.pop(worker.worker_id, None)
        books.prefill_done()
        worker.load.observe_stats(final.stats)
        self.record.add_phase(PhaseStats(worker.worker_id, phase, output_tokens=output_tokens,
                                         stats=final.stats.to_json()))
        if self.hooks.on_phase:
            self.hooks.on_phase(worker.worker_id, phase, final)

    # --- choices ------------------------------------------------------------------------
    def _pick_prefill(self) -> WorkerHandle | None:
        """The retry's worker: the other prefill worker with the least queued prefill."""
        options = [w for w in self.candidates("prefill") if w.worker_id not in self._failed]
        if not options:
            return None
        return min(options, key=lambda w: (w.load.pending_prefill_tokens, w.load.load, w.worker_id))

    def _pick_decode(self) -> WorkerHandle | None:
        options = [w for w in self.candidates("decode") if w.worker_id not in self._failed]
        return pick_decode(options, len(self.prompt_token_ids) + len(self.sent),
                           max(1, self.sampling.max_tokens - len(self.sent)))

    def _route(self, worker: WorkerHandle, phase: str) -> None:
        if self.hooks.on_route:
            self.hooks.on_route(worker.worker_id, phase)

    def _failover(self, kind: str) -> None:
        if self.hooks.on_failover:
            self.hooks.on_failover(kind)

    # --- aborts -------------------------------------------------------------------------
    def _abort_live(self, only: str | None = None) -> None:
        """Tell every worker still holding the request (or just ``only``) to free it. Fire
        and forget: a cancelled task (client gone) must still send it."""
        if only is not None:
            targets = [self._live.pop(only)] if only in self._live else []
        else:
            targets, self._live = list(self._live.values()), {}
        for worker in targets:
            task = asyncio.get_running_loop().create_task(worker.client.abort(self.request_id))
            _background.add(task)
            task.add_done_callback(_background.discard)
