"""The router's scaling evaluation: signals, desired counts, gauges and the JSON report.

``ScalingService(pool, metrics, config, mode)`` evaluates every ``config.interval_s`` while
the router runs (``run()``, a task of the app's lifespan), so the policy's clock advances
whether or not anyone scrapes. Each evaluation reads the pool's books and the router's recent
inter-token latencies (``RouterMetrics.recent_itl``), computes each pool's signals
(``router.scaling.signals``), steps the planner (``router.scaling.policy``) and sets the
``kvrouter_pool_*`` gauges. ``report()`` is ``GET /admin/scaling``'s body::

    {"mode", "config": {...}, "evaluated_unix",
     "pools": {"prefill": {signals..., "pressure", "desired", "proposed", "state"}, "decode": {...}},
     "workers": [{"worker_id", "role", "pool", "draining", "address", "load", "running",
                  "waiting", "pending_prefill_tokens", "kv_free_blocks", "kv_total_blocks"}]}

The colocated state (no prefill worker) is allowed in ``auto`` mode only; in ``colocated``
mode the prefill pool is not used (its desired count is 0).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

from router.metrics import RecentWindow, RouterMetrics
from router.scaling.policy import Decision, Planner, ScalingConfig, pressures
from router.scaling.signals import POOLS, Pool, PoolSignals, pool_of, pool_signals
from router.workers.pool import WorkerPool

__all__ = ["ScalingService"]

log = logging.getLogger(__name__)


class ScalingService:
    """See the module docstring."""

    def __init__(self, pool: WorkerPool, metrics: RouterMetrics, config: ScalingConfig | None = None,
                 mode: str = "disaggregated", clock: Callable[[], float] = time.monotonic) -> None:
        self.pool, self.metrics = pool, metrics
        self.config = config or ScalingConfig()
        self.mode = mode
        self.clock = clock
        self.planner = Planner(self.config, colocated_ok=mode == "auto", prefill_used=mode != "colocated")
        self._signals: dict[Pool, PoolSignals] | None = None
        self._decisions: dict[Pool, Decision] = {}
        self._evaluated_unix: float | None = None
        self._busy = {pool: RecentWindow(clock=clock) for pool in POOLS}

    def evaluate(self) -> None:
        """One evaluation now (module docstring)."""
        itl = self.metrics.recent_itl.mean(self.config.window_s)
        signals = pool_signals([w.load for w in self.pool.workers()], itl)
        for pool in POOLS:   # the share of worker-time prefilling, averaged over the window
            s = signals[pool]
            if s.workers:
                self._busy[pool].add(s.prefilling / s.workers)
            signals[pool] = dataclasses.replace(s, prefill_busy=self._busy[pool].mean(self.config.window_s))
        decisions = self.planner.evaluate(self.clock(), signals)
        self._signals, self._decisions, self._evaluated_unix = signals, decisions, time.time()
        m = self.metrics
        for pool in POOLS:
            s, d = signals[pool], decisions[pool]
            m.pool_workers.labels(pool).set(s.workers)
            m.pool_desired_workers.labels(pool).set(d.desired)
            m.pool_pressure.labels(pool).set(d.pressure)
            m.pool_predicted_ttft.labels(pool).set(s.predicted_ttft_s)
            m.pool_queued_prompt_tokens.labels(pool).set(s.queued_prompt_tokens)
            m.pool_kv_utilization.labels(pool).set(s.kv_utilization)
            m.pool_prefill_busy.labels(pool).set(s.prefill_busy or 0.0)
            if pool == "decode":
                m.pool_itl.labels(pool).set(s.itl_s or 0.0)

    async def run(self) -> None:
        """Evaluate every ``interval_s`` until cancelled; an evaluation that fails is logged."""
        while True:
            try:
                self.evaluate()
            except Exception:  # never let one bad evaluation end scaling
                log.exception("scaling evaluation failed")
            await asyncio.sleep(self.config.interval_s)

    def report(self) -> dict[str, Any]:
        """``GET /admin/scaling`` (module docstring); evaluates first if it never did."""
        if self._signals is None:
            self.evaluate()
        assert self._signals is not None
        p = pressures(self._signals, self.config)
        pools = {pool: {**self._signals[pool].to_json(), "pressure": round(p[pool], 4),
                        **{k: v for k, v in self._decisions[pool].to_json().items()
                           if k in ("desired", "proposed", "state")}}
                 for pool in POOLS}
        workers = []
        for w in sorted(self.pool.workers(), key=lambda h: h.worker_id):
            load, info = w.load, w.info
            workers.append({
                "worker_id": info.worker_id, "role": info.role, "pool": pool_of(load),
                "draining": info.draining, "address": info.address, "load": load.load,
                "running": load.figures.running, "waiting": load.figures.waiting,
                "pending_prefill_tokens": load.pending_prefill_tokens,
                "kv_free_blocks": load.free_blocks,
                "kv_total_blocks": load.figures.kv_total_blocks or info.kv_capacity_blocks})
        return {"mode": self.mode, "config": self.config.to_json(), "evaluated_unix": self._evaluated_unix,
                "pools": pools, "workers": workers}
