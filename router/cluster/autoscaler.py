"""``kvrouter up --autoscale``: the router's per-pool desired counts, acted on inside a budget.

Every ``interval_s`` the :class:`Autoscaler` (a thread of the launcher) reads the router's
``GET /admin/scaling`` (the pools' signals, pressures and desired counts: ``router.scaling``;
the hysteresis and the cool-down are the router's), fits the desired counts into
``max_workers`` (``router.scaling.plan.fit_budget``) and, when the layout it gets differs from
the workers running now, carries out the steps (``router.scaling.plan.actions``) one at a
time with the levers of ``router.cluster.levers``: role changes first (drained first, no
process starts), then stops or starts. The colocated state (no prefill worker: the router's
``auto`` mode has decode workers prefill their own requests) is one of the layouts.

- The workers counted are the launcher's own children (their roles as changed), not the
  router's view, so a worker being restarted by the supervisor still counts against the
  budget; while any worker is not running and ready, or the router does not list it yet,
  the round only waits.
- Each action is a console line (``autoscale: 1P+1D -> colocated x2 (prefill pressure 0.08,
  decode 1.62): role change worker-0 -> decode``, then what it took) and is counted on the
  launcher's metrics: ``kvrouter_up_autoscale_actions_total{action,role}``, with
  ``kvrouter_up_autoscale_workers{pool}`` (the layout) and
  ``kvrouter_up_autoscale_desired_workers{pool}`` (the router's counts, as read).
- ``LOG_DIR/autoscale.jsonl`` is its timeline: a ``"signals"`` line every round (layout,
  each pool's pressure, desired count, predicted TTFT, ITL, KV use) and an ``"action"`` line
  for each action (what, which worker, from and to, seconds, the layouts around it);
  ``benchmarks.planner.autoscale_bench`` plots it.
- A lever that fails is a console line and the next round tries again; the autoscaler's own
  stops are deliberate, so the supervisor leaves them stopped.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from prometheus_client import CollectorRegistry, Counter, Gauge

from kvstore.secret import bearer_headers
from router.cluster.child import ChildProcess
from router.cluster.launcher import LocalCluster
from router.cluster.levers import WORKER_KINDS, LeverCancelled, Levers
from router.scaling.plan import Action, Layout, WorkerState, actions, fit_budget, role_of_pool
from router.scaling.signals import POOLS, Pool

__all__ = ["AutoscaleSpec", "Autoscaler", "AutoscalerMetrics", "TIMELINE_FILE_NAME"]

TIMELINE_FILE_NAME = "autoscale.jsonl"


@dataclass(frozen=True)
class AutoscaleSpec:
    """``max_workers``: the budget (workers running, draining or starting); ``interval_s``:
    how often the router is read; the levers' timeouts."""

    max_workers: int
    interval_s: float = 2.0
    role_timeout_s: float = 600.0
    stop_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {self.max_workers}")
        if self.interval_s <= 0:
            raise ValueError(f"interval_s must be positive, got {self.interval_s}")


class AutoscalerMetrics:
    """The autoscaler's collectors, in the launcher's registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.actions = Counter("kvrouter_up_autoscale_actions",
                               "Autoscaler actions: role changes, starts and stops of workers",
                               ["action", "role"], registry=registry)
        self.workers = Gauge("kvrouter_up_autoscale_workers", "Workers of each pool, as the launcher runs them",
                             ["pool"], registry=registry)
        self.desired = Gauge("kvrouter_up_autoscale_desired_workers",
                             "The router's desired worker count of each pool, as last read", ["pool"],
                             registry=registry)
        for kind in ("role", "start", "stop"):
            for role in ("prefill", "decode"):
                self.actions.labels(kind, role)


def _pool_of_kind(kind: str) -> Pool:
    return "prefill" if kind == "prefill" else "decode"


class Autoscaler:
    """See the module docstring. ``step()`` is one round (tests call it); ``start()`` runs
    rounds on a thread until ``close()``."""

    def __init__(self, cluster: LocalCluster, spec: AutoscaleSpec, say: Callable[[str], None], *,
                 registry: CollectorRegistry | None = None, levers: Levers | None = None) -> None:
        self.cluster, self.spec, self.say = cluster, spec, say
        self.metrics = AutoscalerMetrics(registry or CollectorRegistry())
        self._stop = threading.Event()
        self.levers = levers or Levers(cluster, role_timeout_s=spec.role_timeout_s,
                                       stop_timeout_s=spec.stop_timeout_s, cancelled=self._stop.is_set)
        self._http = httpx.Client(timeout=5.0, trust_env=False)
        self._thread: threading.Thread | None = None
        self._waiting: str | None = None
        assert cluster.log_dir is not None, "start the cluster first"
        self.timeline = Path(cluster.log_dir) / TIMELINE_FILE_NAME
        self.actions_done: list[dict[str, Any]] = []

    # --- running --------------------------------------------------------------------------
    def start(self) -> "Autoscaler":
        self._thread = threading.Thread(target=self._run, name="autoscaler", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self.levers.close()
        self._http.close()

    def _run(self) -> None:
        while not self._stop.wait(self.spec.interval_s):
            try:
                self.step()
            except LeverCancelled:
                return
            except Exception as exc:  # noqa: BLE001 - the router away, a lever that failed: next round
                self.say(f"autoscale: round failed ({type(exc).__name__}: {exc}); trying again")

    # --- one round ------------------------------------------------------------------------
    def workers(self) -> list[ChildProcess]:
        """The worker children that count against the budget (all but stopped ones)."""
        return [c for c in self.cluster.children if c.kind in WORKER_KINDS and not c.deliberate]

    def step(self) -> list[Action]:
        """Read the router, decide, act (module docstring); the actions carried out."""
        report = self._report()
        children = self.workers()
        listed = {w["worker_id"]: w for w in report["workers"]}
        layout = Layout(sum(c.kind == "prefill" for c in children),
                        sum(c.kind != "prefill" for c in children))
        pools = report["pools"]
        desired: dict[Pool, int] = {p: int(pools[p]["desired"]) for p in POOLS}
        pressure: dict[Pool, float] = {p: float(pools[p]["pressure"]) for p in POOLS}
        for p in POOLS:
            self.metrics.workers.labels(p).set(layout.count(p))
            self.metrics.desired.labels(p).set(desired[p])
        self._log({"kind": "signals", "layout": str(layout), "prefill": layout.prefill,
                   "decode": layout.decode, "pools": {p: {k: pools[p].get(k) for k in (
                       "pressure", "desired", "state", "workers", "predicted_ttft_s", "itl_s",
                       "kv_utilization", "queued_prompt_tokens")} for p in POOLS}})
        unready = [c.name for c in children if not c.alive() or c.member_id not in listed]
        if unready:
            self._wait_note(f"waiting for {', '.join(unready)} (not running, or not seen by the router yet)")
            return []
        self._waiting = None
        min_prefill = 0 if report.get("mode") == "auto" else 1
        target = fit_budget(layout, desired, pressure, self.spec.max_workers, min_prefill)
        states = [WorkerState(c.name, _pool_of_kind(c.kind), int(listed[str(c.member_id)]["load"]))
                  for c in children]
        todo = actions(states, target)
        if todo:
            why = ", ".join(f"{p} pressure {pressure[p]:.2f} wants {desired[p]}" for p in POOLS)
            self.say(f"autoscale: {layout} -> {target} ({why})")
        for action in todo:
            self._act(action, layout, target)
        return todo

    def _act(self, action: Action, before: Layout, target: Layout) -> None:
        role = role_of_pool(action.to)
        t0 = time.time()
        self.say(f"autoscale: {action}")
        record: dict[str, Any] = {"kind": "action", "action": action.kind, "worker": action.worker,
                                  "to": role, "layout_before": str(before), "target": str(target)}
        if action.kind == "role":
            assert action.worker is not None
            record["from"] = self.cluster.child(action.worker).kind
            seconds = self.levers.change_role(action.worker, role)
            self.say(f"autoscale: {action.worker} is a {role} worker now ({seconds:.1f} s, drained first)")
        elif action.kind == "start":
            name, seconds = self.levers.start(role)
            record["worker"] = name
            self.say(f"autoscale: {name} started as a {role} worker ({seconds:.1f} s)")
        else:
            assert action.worker is not None
            record["from"] = self.cluster.child(action.worker).kind
            seconds = self.levers.stop(action.worker)
            self.say(f"autoscale: {action.worker} stopped ({seconds:.1f} s, drained first)")
        self.metrics.actions.labels(action.kind, role).inc()
        record.update(started_unix=t0, seconds=round(seconds, 3),
                      layout_after=str(Layout(sum(c.kind == "prefill" for c in self.workers()),
                                              sum(c.kind != "prefill" for c in self.workers()))))
        self.actions_done.append(record)
        self._log(record)

    # --- helpers --------------------------------------------------------------------------
    def _report(self) -> dict[str, Any]:
        url = f"{self.cluster.router_url}/admin/scaling"
        # The admin API takes the cluster secret; a cluster without one, the API key if any.
        resp = self._http.get(url, headers=bearer_headers(self.cluster.secret or self.cluster.spec.api_key))
        resp.raise_for_status()
        return resp.json()

    def _wait_note(self, note: str) -> None:
        if note != self._waiting:
            self._waiting = note
            self.say(f"autoscale: {note}")

    def _log(self, record: dict[str, Any]) -> None:
        with open(self.timeline, "a") as f:
            f.write(json.dumps({"t_unix": round(time.time(), 3), **record}) + "\n")
