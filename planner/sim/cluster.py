"""The simulated cluster: an event loop, the router's real placement code, the workers, a client.

Events are ``(time, seq, fn)`` on a heap; nothing sleeps. One :class:`SimCluster` is one
``kvrouter up``: its :class:`~planner.sim.worker.SimWorker` s, one
:class:`~planner.sim.store.SimStore`, the router's ``KvIndex`` and prefill policy
(``router.placement.prefill.PrefillPolicy``), and the router's decisions made by the router's
own functions, in the order ``router.placement.orchestrator`` makes them:

- ``colocated``: of the workers with room (``router.placement.decode.with_room``) and not
  loaded far past the least loaded (``Balance``), the one the prefill policy prefers runs the
  whole request (phase ``full``);
- ``auto``: the would-be decode worker (``choose_decode``) prefills itself when its uncached
  part is shorter than ``auto_threshold`` (``prefer_local``), else as disaggregated;
- ``disaggregated``: the policy's prefill worker runs phase ``prefill`` (one token, held until
  its blocks are saved), then ``choose_decode`` picks the decode worker, which loads the
  prompt's blocks from the store at admission and generates the rest.

Each phase is booked on the router's ``WorkerLoad`` (``assign``; ``prefill_done`` at its first
token; ``release`` at its final line) exactly as ``router.placement.failover.ChoiceRun`` books
it. Failures, retries and resumes are not simulated.

The client is ``benchmarks.serving.load_client.run_workload``'s: open-loop requests at their
``arrival_s``, follow-ups ``delay_s`` after the request they follow finished, nothing sent after
``max_duration_s``, whatever is in flight ``grace_s`` later cancelled and failed; the run's
duration is the last completion (or that deadline). A request's TTFT, ITL and E2E are what
the client would see: the router forwards tokens as workers produce them (``hop_s`` per
message, 0 by default).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.api.blocks import blocks_needed
from engine.api.generate import RequestStats
from kvstore.keys import BlockKey, block_keys, salted
from planner.metrics import RequestResult
from planner.sim.autoscale import SimAutoscaler
from planner.sim.config import ClusterConfig
from planner.sim.costs import StepCosts
from planner.sim.store import SimStore
from planner.sim.worker import OUTPUT_TOKEN, PhaseState, SimWorker, WorkerSpec
from planner.workloads import BenchRequest
from router.placement.decode import choose_decode, with_room
from router.placement.prefill import PrefillPolicy, prefer_local
from router.placement.route import Route
from router.workers.kv_index import KvIndex

__all__ = ["SimCluster", "RunResult", "Choice"]

NAMESPACE = BlockKey(b"kvplan-simulated")  # 16 bytes: every simulated worker serves one model


@dataclass(eq=False)
class Choice:
    """One client request on its way through the cluster."""

    bench: BenchRequest
    result: RequestResult
    sent_at: float
    namespace: BlockKey
    keys: list[BlockKey]
    route: Route | None = None
    uncached: int = 0
    delivered: int = 0
    last_token_at: float | None = None
    done: bool = False
    first_phase_stats: RequestStats | None = None   # how its prompt was served: its first finished phase's

    @property
    def request_id(self) -> str:
        return self.bench.request_id


@dataclass
class RunResult:
    """One simulated run: what the client saw, and what the cluster did."""

    results: list[RequestResult]
    duration_s: float
    not_sent: int
    routes: dict[str, int]
    worker_busy_s: dict[str, float]
    worker_steps: dict[str, int]
    device_hit_tokens: int
    store_hit_tokens: int
    computed_prompt_tokens: int
    events: int
    autoscale_actions: list[dict[str, Any]] = field(default_factory=list)  # what the autoscaler did


class SimCluster:
    """See the module docstring. ``costs_for(spec)`` gives each worker's step costs (the
    profile measured with that worker's threads)."""

    def __init__(self, config: ClusterConfig, costs_for: Callable[[WorkerSpec], StepCosts]) -> None:
        self.config = config
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self.now = 0.0
        self.events = 0
        specs = config.specs()
        block_bytes = costs_for(specs[0]).block_bytes
        self.hop_s = config.hop_s if config.hop_s is not None else costs_for(specs[0]).hop_s
        self.store = SimStore.of_bytes(config.store_memory_bytes, block_bytes)
        self.index = KvIndex()
        self.policy = PrefillPolicy(config.policy, self.index)  # type: ignore[arg-type]
        self._costs_for = costs_for
        self._counts: dict[str, int] = defaultdict(int)
        self.workers: dict[str, SimWorker] = {}
        for spec in specs:
            self.add_worker(spec)
        self.block_size = specs[0].block_size
        self.routes: dict[str, int] = defaultdict(int)
        self.prompt_stats = RequestStats()   # every choice's first_phase_stats, summed
        self._on_complete: Callable[[Choice, float], None] = lambda c, t: None
        self.closed = False
        self.autoscaler = (None if config.autoscale is None else
                           SimAutoscaler(self, config.autoscale, lambda role: self.add_worker(config.spec_of(role))))

    # --- the fleet -----------------------------------------------------------------------
    def add_worker(self, spec: WorkerSpec) -> SimWorker:
        wid = f"{spec.role}-{self._counts[spec.role]}"
        self._counts[spec.role] += 1
        w = self.workers[wid] = SimWorker(wid, spec, self._costs_for(spec), self.store, self.index,
                                          NAMESPACE, schedule=self.at, on_tokens=self._tokens,
                                          on_finished=self._phase_done)
        return w

    def remove_worker(self, worker_id: str) -> None:
        """A stopped worker: gone from the router's pools and its index."""
        self.workers.pop(worker_id)
        self.index.remove_worker(worker_id)

    # --- the clock ---------------------------------------------------------------------
    def at(self, t: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), fn))

    def run_until(self, t_end: float = math.inf) -> None:
        heap = self._heap
        while heap and heap[0][0] <= t_end:
            t, _, fn = heapq.heappop(heap)
            self.now = t
            self.events += 1
            fn()
        self.now = max(self.now, t_end) if math.isfinite(t_end) else self.now

    # --- the router --------------------------------------------------------------------
    def _handles(self, can: str) -> list[Any]:
        return [w.handle for w in self.workers.values() if not w.info.draining
                and (w.info.can_prefill if can == "prefill" else w.info.can_decode)]

    def submit(self, bench: BenchRequest, t: float, result: RequestResult) -> Choice:
        """The client sends ``bench`` at ``t`` (the router has it ``hop_s`` later)."""
        salt = f"sim-{bench.request_id}" if self.config.salt_per_request else None
        ns = salted(NAMESPACE, salt)
        keys = block_keys(ns, bench.prompt, self.block_size)
        choice = Choice(bench, result, t, ns, keys)
        self.at(t + self.hop_s, lambda: self._route(choice))
        return choice

    def _route(self, c: Choice) -> None:
        cfg, t = self.config, self.now
        n, max_tokens = len(c.bench.prompt), c.bench.max_tokens
        decode = self._handles("decode")
        needs_store = self.policy.name == "kv-aware" or cfg.mode == "auto"
        store_blocks = self.store.peek_prefix_len(c.keys) if needs_store else 0
        if cfg.mode == "colocated":
            fitting = cfg.balance.within(with_room(decode, n, max_tokens))
            chosen = self.policy.choose([w.load for w in fitting], c.keys, n, store_blocks)
            if chosen is None:
                return self._fail(c, f"no worker's KV cache can hold {n} + {max_tokens} tokens")
            self._start(c, Route.COLOCATED, chosen[0].worker_id, chosen[1].uncached_tokens, t)
            return
        prefill = self._handles("prefill")
        if cfg.mode == "auto":
            dec = choose_decode(decode, n, max_tokens)
            if dec is not None:
                local = self.policy.choose([dec.load], c.keys, n, store_blocks)
                assert local is not None
                if prefer_local(local[1], cfg.auto_threshold) or not prefill:
                    self._start(c, Route.AUTO_LOCAL, dec.worker_id, local[1].uncached_tokens, t)
                    return
        chosen = self.policy.choose([w.load for w in prefill], c.keys, n, store_blocks)
        if chosen is None:
            return self._fail(c, "no prefill worker")
        route = Route.AUTO_REMOTE if cfg.mode == "auto" else Route.DISAGGREGATED
        self._start(c, route, chosen[0].worker_id, chosen[1].uncached_tokens, t)

    def _start(self, c: Choice, route: Route, worker_id: str, uncached: int, t: float) -> None:
        c.route, c.uncached = route, uncached
        self.routes[route.value] += 1
        w = self.workers[worker_id]
        n, bs = len(c.bench.prompt), self.block_size
        if route.first_phase == "prefill":
            books = w.load.assign(prefill_tokens=uncached, blocks=blocks_needed(n, 1, bs))
            phase = "prefill"
        else:
            books = w.load.assign(prefill_tokens=uncached, blocks=blocks_needed(n, c.bench.max_tokens, bs))
            phase = "full"
        hop = self.hop_s
        self.at(t + hop, lambda: w.submit(self.now, c, phase, c.bench.prompt, (), c.bench.max_tokens,
                                          books, c.namespace, c.keys))

    def _decode_phase(self, c: Choice, t: float) -> None:
        remaining = c.bench.max_tokens - c.delivered
        if remaining <= 0:
            return self._complete(c, t)
        n = len(c.bench.prompt)
        dec = choose_decode(self._handles("decode"), n + c.delivered, remaining)
        if dec is None:
            return self._fail(c, "no decode worker can hold the request's KV")
        w = self.workers[dec.worker_id]
        books = w.load.assign(prefill_tokens=0,
                              blocks=blocks_needed(n + c.delivered, remaining, self.block_size))
        outputs = (OUTPUT_TOKEN,) * c.delivered
        self.at(t + self.hop_s, lambda: w.submit(self.now, c, "decode", c.bench.prompt, outputs,
                                                        c.bench.max_tokens, books, c.namespace, c.keys))

    # --- what workers report -----------------------------------------------------------
    def _deliver(self, c: Choice, t: float) -> None:
        """One token reaches the client at ``t``."""
        r = c.result
        if c.delivered == 0:
            r.ttft_s = t - c.sent_at
        elif c.last_token_at is not None:
            r.itl_s.append(t - c.last_token_at)
            if self.autoscaler is not None:
                self.autoscaler.observe_itl(t - c.last_token_at)
        c.delivered += 1
        c.last_token_at = t

    def _tokens(self, st: PhaseState, t: float) -> None:
        c: Choice = st.choice
        if c.done:
            return
        st.books.prefill_done()
        self._deliver(c, t + self.hop_s)

    def _phase_done(self, st: PhaseState, t: float) -> None:
        c: Choice = st.choice
        st.books.release()
        p = st.request.stats
        if c.first_phase_stats is None:
            c.first_phase_stats = RequestStats(computed_prompt_tokens=p.computed_prompt_tokens,
                                               device_hit_tokens=p.device_hit_tokens,
                                               store_hit_tokens=p.store_hit_tokens)
            self.prompt_stats = RequestStats.total((self.prompt_stats, c.first_phase_stats))
        if c.done:
            return
        hop = self.hop_s
        if st.phase == "prefill":
            st.books.prefill_done()
            self._deliver(c, t + hop)   # the held first token comes with the final line
            self.at(t + hop, lambda: self._decode_phase(c, self.now))
        else:
            self._complete(c, t + hop)

    def _complete(self, c: Choice, t: float) -> None:
        c.done = True
        c.result.e2e_s = t - c.sent_at
        c.result.output_tokens = c.delivered
        first = c.first_phase_stats or RequestStats()
        c.result.cached_tokens = first.device_hit_tokens + first.store_hit_tokens
        self._on_complete(c, t)

    def _fail(self, c: Choice, why: str) -> None:
        c.done = True
        c.result.error = why
        self._on_complete(c, self.now)

    # --- the client --------------------------------------------------------------------
    def run_workload(self, requests: Sequence[BenchRequest], *, start: float | None = None,
                     max_duration_s: float = math.inf, grace_s: float = 0.0,
                     max_concurrency: int = 0) -> RunResult:
        """Send ``requests`` as the load generator does (module docstring) from ``start``
        (default: now) and run until they are done or cancelled."""
        if self.closed:
            raise RuntimeError("this cluster's last run was cut at its deadline; simulate on a fresh one")
        t0 = self.now if start is None else start
        followers: dict[str, list[BenchRequest]] = defaultdict(list)
        for r in requests:
            if r.after is not None:
                followers[r.after].append(r)
        results: list[RequestResult] = []
        live: dict[str, Choice] = {}
        backlog: list[tuple[BenchRequest, float]] = []
        state = {"last": t0, "left": len(requests)}

        def settled() -> None:   # one request is done with: the autoscaler stops after the last
            state["left"] -= 1
            if state["left"] <= 0 and self.autoscaler is not None:
                self.autoscaler.stop()

        def send(req: BenchRequest, at: float) -> None:
            if at - t0 > max_duration_s:
                for _ in range(1 + _followers_of(req.request_id, followers)):
                    settled()
                return
            if max_concurrency and len(live) >= max_concurrency:
                backlog.append((req, at))
                return
            result = RequestResult(req.request_id, req.tag, len(req.prompt), req.max_tokens,
                                   scheduled_s=at - t0, sent_s=self.now - t0)
            live[req.request_id] = self.submit(req, self.now, result)

        def complete(c: Choice, t: float) -> None:
            if live.pop(c.request_id, None) is None:
                return
            results.append(c.result)
            state["last"] = max(state["last"], t)
            settled()
            for f in followers.get(c.request_id, ()):
                at = t + f.delay_s
                self.at(at, lambda f=f, at=at: send(f, at))
            if backlog:
                req, at = backlog.pop(0)
                self.at(t, lambda: send(req, at))

        self._on_complete = complete
        if self.autoscaler is not None and requests:
            self.autoscaler.start()
        for r in requests:
            if r.after is None:
                at = t0 + r.arrival_s
                self.at(at, lambda r=r, at=at: send(r, at))
        deadline = t0 + max_duration_s + grace_s
        self.run_until(deadline)
        if live:
            for c in live.values():
                c.done = True
                c.result.error = "cancelled at the run's time bound"
                results.append(c.result)
            live.clear()
            state["last"] = deadline
            self._heap.clear()   # what the workers were doing dies with the run
            self.closed = True
        self._on_complete = lambda c, t: None
        acted: list[dict[str, Any]] = []
        if self.autoscaler is not None:
            self.autoscaler.stop()
            acted = [{**a, "started": a["started"] - t0, "t": a["t"] - t0}
                     for a in self.autoscaler.timeline if a["kind"] == "action" and a["started"] >= t0]
        return RunResult(
            results, state["last"] - t0, len(requests) - len(results), dict(self.routes),
            {w: s.busy_s for w, s in self.workers.items()},
            {w: s.steps for w, s in self.workers.items()},
            self.prompt_stats.device_hit_tokens, self.prompt_stats.store_hit_tokens,
            self.prompt_stats.computed_prompt_tokens, self.events, acted)


def _followers_of(request_id: str, followers: dict[str, list[BenchRequest]]) -> int:
    """How many requests follow ``request_id``, transitively (none of them is ever sent once it
    is not)."""
    return sum(1 + _followers_of(f.request_id, followers) for f in followers.get(request_id, ()))
