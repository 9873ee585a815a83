"""One choice's state across workers: prefill (retried once), then decode (resumed).

:class:`ChoiceRun` holds what a choice has done so far (tokens sent, workers holding it, the
router's bookings, each phase's stats) and decides what to do next; it does no I/O of its
own beyond fire-and-forget aborts. The orchestrator's ``serve`` loop drives it, one worker
phase at a time::

    while (phase := run.next_phase()) is not None:     # where, what, booked
        stream phase.request from phase.worker          # run.chunk / run.finished / run.failed
    yield run.final()
    ... finally: run.close()                            # abort whoever still holds it

Where a choice starts is its :class:`~router.placement.route.Plan`:

- route ``first_phase == "prefill"`` (disaggregated, auto-remote): ``phase="prefill"`` on
  ``plan.first`` gives the first token and the prompt's block keys once every full prompt
  block is in the store; then ``phase="decode"`` on a decode worker with
  ``output_token_ids=[first]`` and those ``block_keys`` (the decode worker refuses them with
  409, ``KeyMismatch``, if its own keys differ) and ``kv_source`` = the prefill's ``kv_node``
  (the store node on the prefill's host that holds the blocks: the decode reads them there,
  one hop; ``engine.kv.handoff``) streams the rest. A resume keeps the same source. A vLLM
  prefill's ``kv_transfer_params`` go to the decode the same way (its connector waits for
  the blocks they name: ``kvstore.integrations.vllm``).
- ``"full"`` (colocated, auto-local): one worker prefills and decodes.

Failures (``WorkerUnavailable``: unreachable, 5xx, a broken stream):

- A prefill that fails before its token is retried once on another prefill worker
  (``prefill_retries``, ``router.placement.prefill.choose_retry``); a ``"full"`` run that
  fails before its first token likewise, on a decode worker.
- A stream that breaks after tokens were sent resumes on another decode-capable worker with
  ``phase="decode"`` and ``output_token_ids`` = every token sent so far: that worker loads the
  prompt's full blocks from the store, recomputes the rest, and continues. Sampling
  randomness is a function of ``(seed, position)``, so greedy and seeded requests continue
  exactly as an uninterrupted run would. At most ``max_resumes`` times.
- When no worker is left to try: :class:`~router.placement.errors.NoCapacity`.
- ``WorkerRejected`` (4xx, or ``KeyMismatch``) is not retried: the orchestrator lets it
  propagate (``router.http.errors`` says what the client sees).

A prefill's first token: the worker holds it back until every full prompt block is in the
store and sends it right before its final line (``engine.worker.worker``), so it is handed on
as it arrives, like every other token. A prefill stream that breaks after that token (before
its final line) resumes like a decode stream would: on a decode worker, from the tokens sent.

Every decode worker is chosen by ``router.placement.decode.choose_decode``. Each phase books
its prompt tokens and KV blocks on its worker (``WorkerLoad.assign``) and releases them when
the phase ends, however it ends. Each phase that ended, well or not, is the ``RequestRecord``'s
(its ``PhaseRun``, with the worker's final stats when it finished; both are
``router.placement.request_log``'s); the client's final stats are made from those
(:meth:`ChoiceRun.final`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Literal

from engine.api.blocks import blocks_needed
from engine.api.generate import FinishReason, GenerateChunk, GenerateFinal, GenerateRequest, Phase, RequestStats
from kvstore.keys import BlockKey
from router.placement.decode import choose_decode
from router.placement.errors import NoCapacity
from router.placement.prefill import choose_retry
from router.placement.request_log import PhaseRun, RequestRecord
from router.placement.route import Plan
from router.placement.serving import ServeRequest
from router.workers.client import WorkerUnavailable
from router.workers.pool import WorkerHandle

__all__ = ["ChoiceRun", "RunHooks", "request_stats"]

log = logging.getLogger(__name__)

FailoverKind = Literal["prefill_retry", "decode_resume"]

# Background abort tasks: held here so they are not garbage-collected before they run.
_background: set[asyncio.Task[bool]] = set()


@dataclass(slots=True)
class RunHooks:
    """Callbacks for metrics; all optional. ``on_phase(worker_id, phase, final)`` after each
    worker phase ends; ``on_failover(kind)`` with ``"prefill_retry"`` or ``"decode_resume"``;
    ``on_route(worker_id, phase)`` when a worker is chosen for a phase."""

    on_phase: Callable[[str, Phase, GenerateFinal], None] | None = None
    on_failover: Callable[[FailoverKind], None] | None = None
    on_route: Callable[[str, Phase], None] | None = None


_PROMPT_FIELDS = ("computed_prompt_tokens", "device_hit_tokens", "store_hit_tokens",
                  "queue_s", "prefill_s", "first_token_s")
_MOVED_FIELDS = ("kv_bytes_loaded", "kv_bytes_saved", "store_load_s", "store_save_s")
assert {f.name for f in fields(RequestStats)} == {*_PROMPT_FIELDS, *_MOVED_FIELDS}, \
    "every RequestStats field is either how the prompt was served or what a phase moved"


def request_stats(phases: Sequence[RequestStats]) -> RequestStats:
    """A request's stats from its finished phases' (``router.placement.serving`` says why):
    how the prompt was served is the first phase's figures (a decode phase loads the same
    prompt again; counting it twice would report more cached tokens than the prompt has); KV
    bytes and store seconds are summed over every phase."""
    if not phases:
        return RequestStats()
    figures = {name: getattr(phases[0], name) for name in _PROMPT_FIELDS}
    figures.update({name: sum(getattr(p, name) for p in phases) for name in _MOVED_FIELDS})
    return RequestStats(**figures)


@dataclass(eq=False)
class ChoiceRun:
    """The worker-facing state of one choice (see the module docstring)."""

    request: ServeRequest
    plan: Plan
    candidates: Callable[[Phase], Sequence[WorkerHandle]]   # phase -> eligible workers now
    record: RequestRecord
    hooks: RunHooks = field(default_factory=RunHooks)
    max_prefill_retries: int = 1
    max_resumes: int = 2
    finish_reason: FinishReason | None = None
    sent: list[int] = field(default_factory=list)
    block_keys: list[BlockKey] | None = None       # the prefill's prompt block keys, for the decode
    kv_source: str | None = None                   # the store node the prefill handed them to
    kv_transfer_params: dict | None = None         # a vLLM prefill's, for its decode
    _next: Phase | None = None
    _next_worker: WorkerHandle | None = None
    _current: PhaseRun | None = None
    _live: dict[str, WorkerHandle] = field(default_factory=dict)
    _failed: set[str] = field(default_factory=set)
    _prefill_errors: list[str] = field(default_factory=list)
    _full_retried: bool = False

    def __post_init__(self) -> None:
        self._next, self._next_worker = self.plan.route.first_phase, self.plan.first

    # --- what to run next ---------------------------------------------------------------
    def next_phase(self) -> PhaseRun | None:
        """The next worker phase (booked, recorded, its worker now holding the request), or
        None when the choice is done (``finish_reason`` set). Raises ``NoCapacity``."""
        phase = self._next
        if phase is None:
            return None
        rec, worker = self.record, self._next_worker
        max_tokens = self.request.sampling.max_tokens
        prompt = self.request.prompt_token_ids
        if phase == "prefill":
            assert worker is not None, "a prefill phase always has its worker"
            rec.prefill_worker = worker.worker_id
            rec.mark("prefill_start")
            books = worker.load.assign(prefill_tokens=self.plan.uncached_tokens,
                                       blocks=blocks_needed(len(prompt), 1, worker.info.block_size))
        else:
            remaining = max_tokens - len(self.sent)
            if remaining <= 0:
                self.finish_reason, self._next = "length", None
                return None
            if worker is None:
                options = [w for w in self.candidates("decode") if w.worker_id not in self._failed]
                worker = choose_decode(options, len(prompt) + len(self.sent), remaining)
            if worker is None:
                raise NoCapacity(
                    "no decode worker can hold the request's KV"
                    + (" to resume it" if self.sent else "")
                    + (f" (workers that failed it: {sorted(self._failed)})" if self._failed else ""))
            rec.decode_workers.append(worker.worker_id)
            # A "full" phase prefills where it decodes: no transfer, its first token ends
            # the prefill. A decode phase starts with the transfer (the store load).
            rec.mark("prefill_start" if phase == "full" else "transfer_start")
            books = worker.load.assign(
                prefill_tokens=self.plan.uncached_tokens if phase == "full" and not self.sent else 0,
                blocks=blocks_needed(len(prompt) + len(self.sent), remaining, worker.info.block_size))
        request = GenerateRequest(self.request.request_id, prompt, self.request.sampling,
                                  list(self.sent), self.request.cache_salt, phase,
                                  block_keys=self.block_keys if phase == "decode" else None,
                                  kv_source=self.kv_source if phase == "decode" else None,
                                  kv_transfer_params=self.kv_transfer_params if phase == "decode" else None)
        self._next = self._next_worker = None
        self._live[worker.worker_id] = worker
        if self.hooks.on_route:
            self.hooks.on_route(worker.worker_id, phase)
        self._current = PhaseRun(worker, phase, request, books)
        return self._current

    # --- what a phase streams -----------------------------------------------------------
    def chunk(self, run: PhaseRun, chunk: GenerateChunk) -> GenerateChunk | None:
        """A token line of ``run``: the chunk to hand on (None: it holds no token)."""
        run.books.prefill_done()
        if not chunk.token_ids:
            return None
        run.output_tokens += len(chunk.token_ids)
        self.record.mark("decode_first" if run.phase == "decode" else "prefill_end")
        self.sent.extend(chunk.token_ids)
        return chunk

    def finished(self, run: PhaseRun, final: GenerateFinal) -> None:
        """``run``'s final line: recorded; a prefill's plans the decode."""
        self._end(run)
        self._live.pop(run.worker_id, None)
        run.worker.load.observe_stats(final.stats)
        run.stats = final.stats
        self.record.phases.append(run)
        if self.hooks.on_phase:
            self.hooks.on_phase(run.worker_id, run.phase, final)
        if run.phase != "prefill":
            self.finish_reason = final.finish_reason
            self.record.mark("decode_end")
            return
        self.record.mark("prefill_end")
        self.block_keys, self.kv_source = final.block_keys, final.kv_node
        self.kv_transfer_params = final.kv_transfer_params
        if final.finish_reason == "stop" or len(self.sent) >= self.request.sampling.max_tokens:
            self.finish_reason = "stop" if final.finish_reason == "stop" else "length"
        else:
            self._next = "decode"

    def failed(self, run: PhaseRun, exc: WorkerUnavailable) -> None:
        """``run``'s worker failed it: plan the retry or the resume, or raise ``NoCapacity``."""
        self._end(run)
        wid = run.worker_id
        self._failed.add(wid)
        self._abort(self._live.pop(wid, None))         # a 5xx from a live worker: free it there
        run.error = str(exc)
        self.record.phases.append(run)
        if run.phase == "prefill" and not self.sent:
            self._prefill_errors.append(str(exc))
            log.warning("request %s: prefill on %s failed (%s)", self.request.request_id, wid, exc)
            attempts = len(self._prefill_errors)
            if attempts <= self.max_prefill_retries:
                self.record.prefill_retries += 1
                self._failover("prefill_retry")
                retry = choose_retry(self.candidates("prefill"), self._failed)
                if retry is not None:
                    self._next, self._next_worker = "prefill", retry
                    return
            raise NoCapacity("no prefill worker could take the request: "
                             + "; ".join(self._prefill_errors)) from exc
        log.warning("request %s: %s on %s failed after %d tokens (%s)", self.request.request_id,
                    run.phase, wid, len(self.sent), exc)
        if run.phase == "full" and not self.sent and not self._full_retried:
            self._full_retried = True                  # nothing sent yet: a plain retry
            self.record.prefill_retries += 1
            self._failover("prefill_retry")
            self._next = "full"
            return
        if self.record.decode_resumes >= self.max_resumes:
            raise NoCapacity(f"request {self.request.request_id}: gave up after "
                             f"{self.record.decode_resumes} resumes: {exc}") from exc
        self.record.decode_resumes += 1
        self._failover("decode_resume")
        self._next = "decode" if self.sent else run.phase   # continue from the store + sent tokens

    def rejected(self, run: PhaseRun) -> None:
        """``run``'s worker refused the request (4xx): it holds nothing; the caller re-raises."""
        self._end(run)
        self._live.pop(run.worker.worker_id, None)

    def final(self) -> GenerateFinal:
        """The choice's last item: its finish reason and the request's stats."""
        return GenerateFinal(self.finish_reason or "length", request_stats(
            [p.stats for p in self.record.phases if p.stats is not None]))

    def close(self) -> None:
        """However the choice ended: release the books, tell every worker still holding the
        request to free it. Fire and forget: a cancelled task (client gone) must still send it."""
        if self._current is not None:
            self._end(self._current)
        live, self._live = list(self._live.values()), {}
        for worker in live:
            self._abort(worker)

    # --- helpers ------------------------------------------------------------------------
    def _end(self, run: PhaseRun) -> None:
        run.books.release()
        if self._current is run:
            self._current = None

    def _failover(self, kind: FailoverKind) -> None:
        if self.hooks.on_failover:
            self.hooks.on_failover(kind)

    def _abort(self, worker: WorkerHandle | None) -> None:
        if worker is None:
            return
        task = asyncio.get_running_loop().create_task(worker.client.abort(self.request.request_id))
        _background.add(task)
        task.add_done_callback(_background.discard)
