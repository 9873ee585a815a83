"""The router's Prometheus metrics, in a registry of its own (no process-wide state).

Latencies: TTFT (arrival → first token), inter-token latency (between streamed tokens), TPOT
((end - first token) / (tokens - 1)), end-to-end. Routing: decisions per worker and phase,
decisions per route (``kind`` = a ``router.placement.route.Route``: ``disaggregated``,
``colocated``, ``auto-local``: auto mode prefilling on the decode worker, ``auto-remote``,
``store-down``: the decode worker prefilling because the store is down). Cache: prompt tokens
found in each tier (``device``, ``store``) and computed.
Transfer: KV bytes and seconds to and from the store. Requests by endpoint and status.

Scaling (``router.scaling``, set by each evaluation, label ``pool`` = ``prefill`` | ``decode``):
``kvrouter_pool_workers`` (in the pool, draining ones not counted), ``kvrouter_pool_desired_workers``
(the planner's count, for an external autoscaler), ``kvrouter_pool_pressure`` (the pool's
signal over its objective: 1 is at it), ``kvrouter_pool_predicted_ttft_seconds`` (queued
prompt tokens over the measured prefill rate, plus one typical prefill),
``kvrouter_pool_queued_prompt_tokens``, ``kvrouter_pool_prefill_busy`` (the share of the
pool's worker-time spent computing a prompt, over the recent window),
``kvrouter_pool_kv_utilization`` and
``kvrouter_pool_itl_seconds`` (decode: the mean inter-token latency of the recent window;
every ``itl`` observation also lands in ``recent_itl``, a ``RecentWindow``).

``RecentWindow`` (a bounded, clock-injected window of recent samples) lives here, below
``router.scaling``, which reads it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from engine.api.generate import RequestStats

__all__ = ["RouterMetrics", "RecentWindow", "CONTENT_TYPE_LATEST"]

_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
            1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 60.0)


class RecentWindow:
    """The mean of the samples of the last N seconds, in bounded memory (the router's
    inter-token latencies; the scaling service's busy time per pool).

    Samples are summed into one-second buckets (a deque of at most ``horizon_s`` of them), so
    a stream of thousands of inter-token gaps a second costs one addition each and the memory
    is a function of the horizon alone. ``mean(window_s)`` is over the buckets whose second
    falls within the last ``window_s`` seconds (the current, partial one included). The clock
    is injected (``time.monotonic`` by default), so tests drive it."""

    def __init__(self, horizon_s: float = 300.0, clock: Callable[[], float] = time.monotonic) -> None:
        if horizon_s < 1:
            raise ValueError(f"horizon_s must be >= 1, got {horizon_s}")
        self.horizon_s = horizon_s
        self._clock = clock
        self._buckets: deque[list[float]] = deque()   # [second, sum, count], oldest first

    def add(self, value: float) -> None:
        second = float(int(self._clock()))
        if self._buckets and self._buckets[-1][0] == second:
            bucket = self._buckets[-1]
            bucket[1] += value
            bucket[2] += 1
        else:
            self._buckets.append([second, value, 1])
            self._prune(second)

    def _prune(self, now: float) -> None:
        while self._buckets and self._buckets[0][0] <= now - self.horizon_s:
            self._buckets.popleft()

    def stats(self, window_s: float) -> tuple[int, float]:
        """(samples, their sum) over the last ``window_s`` seconds."""
        oldest = int(self._clock()) - window_s
        n, total = 0, 0.0
        for second, s, c in reversed(self._buckets):
            if second <= oldest:
                break
            n += int(c)
            total += s
        return n, total

    def mean(self, window_s: float) -> float | None:
        """The mean of the last ``window_s`` seconds' samples; None when there were none."""
        n, total = self.stats(window_s)
        return total / n if n else None


class _WindowedHistogram:
    """A histogram whose observations also go to a :class:`RecentWindow` (``observe`` only)."""

    def __init__(self, histogram: Histogram, window: RecentWindow) -> None:
        self.histogram, self.window = histogram, window

    def observe(self, value: float) -> None:
        self.histogram.observe(value)
        self.window.add(value)


_FAST = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1)


class RouterMetrics:
    """All router collectors; ``render()`` gives the ``/metrics`` body."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry if registry is not None else CollectorRegistry()
        self.ttft = Histogram("kvrouter_time_to_first_token_seconds",
                              "Arrival to first token", buckets=_LATENCY, registry=r)
        self.recent_itl = RecentWindow()
        self.itl = _WindowedHistogram(Histogram("kvrouter_inter_token_latency_seconds",
                                                "Time between streamed tokens", buckets=_LATENCY,
                                                registry=r), self.recent_itl)
        self.tpot = Histogram("kvrouter_time_per_output_token_seconds",
                              "(end - first token) / (output tokens - 1)", buckets=_LATENCY, registry=r)
        self.e2e = Histogram("kvrouter_e2e_request_latency_seconds",
                             "Arrival to last token", buckets=_LATENCY, registry=r)
        self.decision_time = Histogram("kvrouter_routing_decision_seconds",
                                       "Index lookup plus scoring", buckets=_FAST, registry=r)
        self.routing_decisions = Counter("kvrouter_routing_decisions",
                                         "Requests sent to each worker, by phase",
                                         ["worker", "phase"], registry=r)
        self.route_kind = Counter("kvrouter_route_kind",
                                  "Requests by route: disaggregated, colocated, auto-local, auto-remote, store-down",
                                  ["kind"], registry=r)
        self.prompt_tokens = Counter("kvrouter_prompt_tokens", "Prompt tokens", registry=r)
        self.generation_tokens = Counter("kvrouter_generation_tokens", "Output tokens", registry=r)
        self.prefix_hit_tokens = Counter("kvrouter_prefix_hit_tokens",
                                         "Prompt tokens found cached, by tier", ["tier"], registry=r)
        self.computed_prompt_tokens = Counter("kvrouter_computed_prompt_tokens",
                                              "Prompt tokens computed by workers", registry=r)
        self.transfer_bytes = Counter("kvrouter_kv_transfer_bytes",
                                      "KV bytes moved to (save) or from (load) the store",
                                      ["direction"], registry=r)
        self.transfer_seconds = Counter("kvrouter_kv_transfer_seconds",
                                        "Seconds spent moving KV to or from the store",
                                        ["direction"], registry=r)
        self.requests = Counter("kvrouter_requests", "Finished requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.in_flight = Gauge("kvrouter_requests_in_flight", "Requests being served", registry=r)
        self.workers = Gauge("kvrouter_workers", "Known workers by role", ["role"], registry=r)
        pool = ["pool"]
        self.pool_workers = Gauge("kvrouter_pool_workers", "Workers in the pool (draining ones not counted)",
                                  pool, registry=r)
        self.pool_desired_workers = Gauge("kvrouter_pool_desired_workers",
                                          "The scaling planner's desired worker count of the pool",
                                          pool, registry=r)
        self.pool_pressure = Gauge("kvrouter_pool_pressure",
                                   "The pool's scaling signal over its objective (1: at the objective)",
                                   pool, registry=r)
        self.pool_predicted_ttft = Gauge("kvrouter_pool_predicted_ttft_seconds",
                                         "Queued prompt tokens over the measured prefill rate, plus one "
                                         "typical prefill",
                                         pool, registry=r)
        self.pool_queued_prompt_tokens = Gauge("kvrouter_pool_queued_prompt_tokens",
                                               "Prompt tokens queued for prefill in the pool", pool, registry=r)
        self.pool_kv_utilization = Gauge("kvrouter_pool_kv_utilization",
                                         "KV-cache blocks in use over the pool's blocks", pool, registry=r)
        self.pool_prefill_busy = Gauge("kvrouter_pool_prefill_busy",
                                       "Share of the pool's worker-time spent computing a prompt (recent window)",
                                       pool, registry=r)
        self.pool_itl = Gauge("kvrouter_pool_itl_seconds",
                              "Mean inter-token latency of the recent window (the decode pool)",
                              pool, registry=r)
        for tier in ("device", "store"):
            self.prefix_hit_tokens.labels(tier)
        for direction in ("save", "load"):
            self.transfer_bytes.labels(direction)
            self.transfer_seconds.labels(direction)

    def observe_worker_stats(self, stats: RequestStats) -> None:
        """Account one worker phase's final stats (cache hits, computed tokens, transfers)."""
        self.prefix_hit_tokens.labels("device").inc(stats.device_hit_tokens)
        self.prefix_hit_tokens.labels("store").inc(stats.store_hit_tokens)
        self.computed_prompt_tokens.inc(stats.computed_prompt_tokens)
        self.transfer_bytes.labels("save").inc(stats.kv_bytes_saved)
        self.transfer_bytes.labels("load").inc(stats.kv_bytes_loaded)
        self.transfer_seconds.labels("save").inc(stats.store_save_s)
        self.transfer_seconds.labels("load").inc(stats.store_load_s)

    def record_decision(self, worker_id: str, phase: str, seconds: float | None = None) -> None:
        self.routing_decisions.labels(worker_id, phase).inc()
        if seconds is not None:
            self.decision_time.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
