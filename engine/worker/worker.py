"""EngineWorker: the one thread that drives an ``LLMEngine`` beside the HTTP server.

Contract:

- The engine is touched only by the worker's thread. Other threads (the server's event loop)
  talk to it through a FIFO inbox: ``submit`` (resolves a future once the engine accepted or
  rejected the request: ``ValueError`` for bad input, before any state changed) and ``abort``.
- A request's outputs go to its ``sink``, a callable taking ``GenerateChunk`` / ``GenerateFinal``
  that must be thread-safe and must not block (the server's sink is
  ``loop.call_soon_threadsafe(queue.put_nowait, item)``). The final line comes last, once the
  connector has acknowledged the request's saves; a phase="prefill" request's first token is
  held back until then too (the handoff: every full block is in the store), and its final
  line carries the prompt's full-block keys (``GenerateFinal.block_keys``). With ``handoff``
  (the default) those blocks go to this host's store node and the final line names it
  (``kv_node``); a request that carries ``kv_source`` loads from that node first
  (``engine.kv.handoff``).
- A request that carries ``block_keys`` (a decode handoff) is admitted only if they equal the
  engine's own keys for the prompt; otherwise ``submit``'s future fails with
  ``BlockKeyMismatch`` (the server answers 409).
- Phases: ``"prefill"`` runs the prompt and samples one token, saving its blocks even on a
  worker that does not save by default; ``"decode"`` and ``"full"`` generate up to
  ``max_tokens``, loading store hits on admission either way.
- The worker measures each step (wall time, prefill and decode tokens via a thin wrapper
  around the runner), feeds ``WorkerMetrics`` and publishes load reports on the
  ``EventStream`` at most every ``load_interval_s`` when they changed.
- ``step_trace``, when given (``kvengine serve --step-trace FILE``), gets one JSON line per
  step that computed anything: ``{"t": wall clock, "step_s": the whole step, "execute_s": the
  model's share, "items": [[tokens, start], ...]}`` (a decode is ``[1, context]``): what the
  simulator's step times (``planner.sim.costs``) are checked against under real load.
- ``drain()`` refuses new requests (``submit`` raises ``Draining``); ``idle`` says when
  every accepted request has delivered its final line (``in_flight``: how many have not).
  A role change (``engine.worker.role``) does not drain this way: it keeps accepting.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TextIO

import torch

from engine.api.events import LoadFigures
from engine.api.generate import GenerateChunk, GenerateFinal, GenerateRequest, RequestStats
from engine.core.llm_engine import BlockKeyMismatch, LLMEngine, RequestOutput
from engine.core.request import RequestKV
from engine.kv.connector import KVStoreConnector, SaveResult
from engine.worker.events import EventStream, RateMeter
from engine.worker.metrics import WorkerMetrics
from kvstore.keys import BlockKey

if TYPE_CHECKING:
    from engine.model.config import ModelConfig
    from engine.model.runner import ModelRunner, StepItem

__all__ = ["Draining", "EngineWorker", "MeasuredRunner", "Sink"]

log = logging.getLogger(__name__)

Sink = Callable[[GenerateChunk | GenerateFinal], None]


class Draining(RuntimeError):
    """The worker is draining before exit and takes no new requests; send it elsewhere."""


class MeasuredRunner:
    """Wraps a model runner and records what each ``execute`` computed (prefill vs decode)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.inner = runner
        self.config: ModelConfig = runner.config
        self.block_size = runner.block_size
        self.num_blocks = runner.num_blocks
        self.kv_cache = runner.kv_cache
        self.prefill_tokens = 0
        self.decode_tokens = 0
        self.items: list[tuple[int, int]] = []   # (tokens, start) of each item, since take
        self.execute_s = 0.0                       # time inside the model, since take

    def facts(self) -> dict[str, Any]:
        return self.inner.facts()

    def execute(self, items: list[StepItem]) -> torch.Tensor:
        for item in items:
            n = len(item.token_ids)
            if n == 1 and item.start_pos > 0:
                self.decode_tokens += 1
            else:
                self.prefill_tokens += n
            self.items.append((n, item.start_pos))
        t0 = time.perf_counter()
        out = self.inner.execute(items)
        self.execute_s += time.perf_counter() - t0
        return out

    def take(self) -> tuple[int, int]:
        """(prefill, decode) tokens computed since the last call."""
        out = (self.prefill_tokens, self.decode_tokens)
        self.prefill_tokens = self.decode_tokens = 0
        return out

    def take_shape(self) -> tuple[list[tuple[int, int]], float]:
        """The items executed since the last call, and the time the model took for them."""
        out = (self.items, self.execute_s)
        self.items, self.execute_s = [], 0.0
        return out


@dataclass
class _Stream:
    request: GenerateRequest
    sink: Sink
    held: list[GenerateChunk] = field(default_factory=list)  # a prefill's token, until acked
    got_first_token: bool = False
    prompt_keys: list[BlockKey] | None = None  # a prefill's full prompt block keys, for its final line


@dataclass(frozen=True, slots=True)
class _Add:
    request: GenerateRequest
    sink: Sink
    accepted: Future[None]


@dataclass(frozen=True, slots=True)
class _Abort:
    request_id: str


_Message = _Add | _Abort | None  # None only wakes the engine thread (to stop, or I/O ended)


class EngineWorker:
    """Runs ``engine.step()`` in a dedicated thread; see the module docstring."""

    def __init__(
        self,
        engine: LLMEngine,
        runner: MeasuredRunner,
        events: EventStream,
        metrics: WorkerMetrics,
        *,
        connector: KVStoreConnector | None = None,
        load_interval_s: float = 0.5,
        handoff: bool = True,
        step_trace: TextIO | None = None,
    ) -> None:
        self.engine = engine
        self.handoff = handoff          # a prefill's blocks to this host's node (engine.kv.handoff)
        self.runner = runner
        self.events = events
        self.metrics = metrics
        self.connector = connector
        self.load_interval_s = load_interval_s
        self.step_trace = step_trace
        self.prefill_rate = RateMeter()
        self.decode_rate = RateMeter()
        self.load_rate = RateMeter()
        self._inbox: queue.SimpleQueue[_Message] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}          # engine thread only
        self._open = 0                                   # accepted, final line not delivered
        self._open_lock = threading.Lock()
        self._draining = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._last_load: LoadFigures | None = None
        self._last_load_time = 0.0
        self._last_conn = connector.stats_snapshot() if connector is not None else None
        if connector is not None:
            connector.on_ready = lambda: self._inbox.put(None)   # wakes a loop waiting on I/O
        self.error: BaseException | None = None
        metrics.kv_total_blocks.set(engine.config.num_blocks)

    # --- any thread -------------------------------------------------------------------------

    def start(self) -> "EngineWorker":
        self._thread.start()
        return self

    def submit(self, request: GenerateRequest, sink: Sink) -> Future[None]:
        """Queue ``request``; the future resolves to None once accepted, or to the error."""
        if self._draining.is_set():
            raise Draining("this worker is draining before exit; retry on another worker")
        if not self.alive:
            raise RuntimeError(f"the engine thread has stopped: {self.error!r}")
        fut: Future[None] = Future()
        self._inbox.put(_Add(request, sink, fut))
        return fut

    def abort(self, request_id: str) -> None:
        self._inbox.put(_Abort(request_id))

    def drain(self) -> None:
        self._draining.set()
        self.metrics.draining.set(1)

    @property
    def draining(self) -> bool:
        return self._draining.is_set()

    @property
    def idle(self) -> bool:
        with self._open_lock:
            return self._open == 0

    @property
    def in_flight(self) -> int:
        """Requests accepted whose final line is not delivered yet."""
        with self._open_lock:
            return self._open

    def set_save_all(self, save_all: bool) -> None:
        """Whether every request's new full blocks go to the store (a role change: see
        ``WorkerConfig.saves_all_as``); read by the engine thread at each save decision."""
        if self.connector is not None:
            self.connector.save_all = save_all

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._inbox.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout)
        if self.connector is not None:
            self.connector.close()

    # --- the engine thread ------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._publish_load(force=True)
            while not self._stop.is_set():
                # Nothing to compute while every request waits on the store's I/O: sleep on
                # the inbox, which the connector's on_ready wakes when a lookup or load ends.
                busy = self.engine.has_unfinished() and not self.engine.waiting_on_io
                self._handle_inbox(block=not busy)
                if self.engine.has_unfinished():
                    self._step()
                self._publish_load()
        except BaseException as exc:  # the worker reports it on /health; requests get a final line
            self.error = exc
            log.exception("engine thread died")
            for rid, stream in list(self._streams.items()):
                self._close(rid, stream, GenerateFinal("abort"))
            self._streams.clear()
            while True:  # requests queued behind the failure: refuse them, never leave them hanging
                try:
                    message = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if isinstance(message, _Add):
                    message.accepted.set_exception(
                        RuntimeError(f"the engine thread has stopped: {exc!r}"))

    def _handle_inbox(self, block: bool) -> None:
        timeout = self.load_interval_s if block else None
        while True:
            try:
                message = (self._inbox.get(timeout=timeout) if timeout is not None
                           else self._inbox.get_nowait())
            except queue.Empty:
                return
            timeout = None  # only the first wait blocks
            if isinstance(message, _Add):
                self._add(message.request, message.sink, message.accepted)
            elif isinstance(message, _Abort):
                self.engine.abort(message.request_id)

    def _add(self, request: GenerateRequest, sink: Sink, fut: Future[None]) -> None:
        params = request.sampling
        if request.phase == "prefill":
            # One token here; min_tokens still holds the stop ids back if it is not reached.
            one = len(request.output_token_ids) + 1
            params = dataclasses.replace(params, max_tokens=one, min_tokens=min(params.min_tokens, one))
        try:
            if request.request_id in self._streams:
                raise ValueError(f"request {request.request_id!r}: the id is already in use")
            total = len(request.prompt_token_ids) + request.sampling.max_tokens
            if request.phase == "prefill" and total > self.engine.max_model_len:
                # The engine checks the one token it will run; the decode will need them all.
                raise ValueError(
                    f"request {request.request_id!r}: prompt ({len(request.prompt_token_ids)} "
                    f"tokens) + max_tokens ({request.sampling.max_tokens}) = {total} exceeds "
                    f"the context window of {self.engine.max_model_len} tokens")
            prefill = request.phase == "prefill"
            kv = RequestKV(save=prefill, handoff=prefill and self.handoff, source=request.kv_source)
            self.engine.add_request(request.request_id, request.prompt_token_ids, params,
                                    output_token_ids=request.output_token_ids,
                                    cache_salt=request.cache_salt,
                                    block_keys=request.block_keys, kv=kv)
        except ValueError as exc:
            reason = "block_keys" if isinstance(exc, BlockKeyMismatch) else "bad_request"
            self.metrics.rejected.labels(reason).inc()
            fut.set_exception(exc)
            return
        stream = _Stream(request, sink)
        if request.phase == "prefill":
            stream.prompt_keys = self.engine.prompt_block_keys(request.request_id)
        self._streams[request.request_id] = stream
        with self._open_lock:
            self._open += 1
        fut.set_result(None)

    def _step(self) -> None:
        t0 = time.perf_counter()
        outputs = self.engine.step()
        dt = time.perf_counter() - t0
        prefill, decode = self.runner.take()
        if prefill or decode:
            kind = "mixed" if prefill and decode else ("prefill" if prefill else "decode")
            self.metrics.step_seconds.labels(kind).observe(dt)
            # A mixed step's time is shared by its tokens: attribute it by token count.
            total = prefill + decode
            self.prefill_rate.update(prefill, dt * prefill / total)
            self.decode_rate.update(decode, dt * decode / total)
        items, execute_s = self.runner.take_shape()
        if self.step_trace is not None and items:
            self.step_trace.write(json.dumps({"t": round(time.time(), 4), "step_s": round(dt, 6),
                                              "execute_s": round(execute_s, 6), "items": items}) + "\n")
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.new_token_ids:
                self.metrics.generated_tokens.inc(len(out.new_token_ids))
                if not stream.got_first_token:
                    stream.got_first_token = True
                    self.metrics.time_to_first_token.observe(out.stats.first_token_s)
                chunk = GenerateChunk(list(out.new_token_ids), out.new_logprobs)
                if stream.request.phase == "prefill":
                    stream.held.append(chunk)
                else:
                    stream.sink(chunk)
            if out.finished:
                self._finish(out, stream)
        self._update_connector_metrics()

    def _finish(self, out: RequestOutput, stream: _Stream) -> None:
        rid = out.request_id
        reason = out.finish_reason
        assert reason is not None, "a finished output names its reason"
        s = out.stats
        self.metrics.requests.labels(reason).inc()
        self.metrics.prefix_hit_tokens.labels("device").inc(s.device_hit_tokens)
        self.metrics.prefix_hit_tokens.labels("store").inc(s.store_hit_tokens)
        self.metrics.computed_prompt_tokens.inc(s.computed_prompt_tokens)
        loaded = out.kv.load
        stats = RequestStats(
            computed_prompt_tokens=s.computed_prompt_tokens,
            device_hit_tokens=s.device_hit_tokens,
            store_hit_tokens=s.store_hit_tokens,
            kv_bytes_loaded=loaded.bytes,
            store_load_s=loaded.seconds,
            queue_s=s.queue_s, prefill_s=s.prefill_s, first_token_s=s.first_token_s,
        )
        del self._streams[rid]
        if self.connector is None:
            self._close(rid, stream, GenerateFinal(reason, stats, stream.prompt_keys))
            return
        acked_from = time.perf_counter()

        def saved(fut: Future[SaveResult]) -> None:  # on the saver thread (or here, if done)
            result: SaveResult = fut.result()
            stats.kv_bytes_saved, stats.store_save_s = result.bytes, result.seconds
            if stream.request.phase == "prefill":
                self.metrics.store_save_seconds.observe(time.perf_counter() - acked_from)
                if result.failed_blocks:
                    log.warning("request %s: %d blocks could not be saved; the decode worker "
                                "will recompute them", rid, result.failed_blocks)
            self._close(rid, stream, GenerateFinal(reason, stats, stream.prompt_keys,
                                                   result.node if stream.prompt_keys else None))

        self.connector.flush(rid).add_done_callback(saved)

    def _close(self, rid: str, stream: _Stream, final: GenerateFinal) -> None:
        for chunk in stream.held:
            stream.sink(chunk)
        stream.held.clear()
        stream.sink(final)
        with self._open_lock:
            self._open -= 1

    def _update_connector_metrics(self) -> None:
        last = self._last_conn
        if self.connector is None or last is None:
            return
        now = self._last_conn = self.connector.stats_snapshot()
        self.metrics.store_bytes.labels("load").inc(now.loaded_bytes - last.loaded_bytes)
        self.metrics.store_bytes.labels("save").inc(now.saved_bytes - last.saved_bytes)
        self.metrics.store_blocks_bad.labels("missing").inc(now.missing_blocks - last.missing_blocks)
        self.metrics.store_blocks_bad.labels("corrupt").inc(now.corrupt_blocks - last.corrupt_blocks)
        for kind, field_name in (("handed_off", "handoff_blocks"), ("source_hit", "source_hit_blocks"),
                                 ("placed", "placed_blocks"), ("place_dropped", "place_dropped_blocks")):
            self.metrics.handoff_blocks.labels(kind).inc(getattr(now, field_name) - getattr(last, field_name))
        self.load_rate.update((now.loaded_blocks - last.loaded_blocks) * self.connector.block_size,
                              now.load_s - last.load_s)

    def _publish_load(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_load_time < self.load_interval_s:
            return
        bm = self.engine.block_manager
        load = LoadFigures(
            waiting=self.engine.num_waiting,
            # A request loading its KV holds its blocks and a sequence slot: it runs next.
            running=self.engine.num_running + self.engine.num_loading,
            kv_free_blocks=bm.num_free_blocks,
            kv_total_blocks=bm.num_blocks,
            prefill_tokens_per_s=round(self.prefill_rate.rate, 1),
            load_tokens_per_s=round(self.load_rate.rate, 1),
            decode_tokens_per_s=round(self.decode_rate.rate, 1),
        )
        self.metrics.waiting.set(load.waiting)
        self.metrics.running.set(load.running)
        self.metrics.kv_free_blocks.set(load.kv_free_blocks)
        self.metrics.kv_usage.set(bm.usage)
        self._last_load_time = now
        if force or load != self._last_load:
            self._last_load = load
            self.events.publish_load(load)
