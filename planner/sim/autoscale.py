"""``kvrouter up --autoscale``, simulated: the router's scaling code and the launcher's plan on
the virtual clock.

Nothing here decides anything of its own. Every ``scaling.interval_s`` the router's evaluation
runs as ``router.scaling.service.ScalingService.evaluate`` runs it: ``pool_signals`` over the
simulated workers' ``WorkerLoad`` s with the recent inter-token latency (a ``RecentWindow`` fed
every gap the client sees), each pool's prefill-busy share averaged over the window, then
``router.scaling.policy.Planner.evaluate`` (the hysteresis and the cool-down). Every
``interval_s`` the launcher's round runs as ``router.cluster.autoscaler.Autoscaler.step`` does:
the layout of the workers that count, ``fit_budget`` within ``max_workers``, ``actions``, and
the actions carried out one at a time, the next round waiting until they are done (the real
levers block). What each lever costs, on the virtual clock:

- a role change (``engine.worker.role``): the worker is marked draining at once (the router
  sends it nothing new), its phases run to their end, and the change takes effect once
  ``settle_s`` has passed and none is left; a change that adds phases (to colocated) needs no
  drain;
- a stop: the same drain, then the worker is gone (its device cache leaves the router's index);
- a start: a fresh worker of the role's spec after ``start_s``, an assumption (a process
  start and a model load; ``kvrouter up`` logs it as ``started ... (N s)``), not measured by
  the profile.

The timeline (:attr:`SimAutoscaler.timeline`) has a ``signals`` record a round and an
``action`` record per action, in the shape of the launcher's ``autoscale.jsonl`` (times are
the simulation's seconds).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from engine.worker.role import needs_drain
from router.metrics import RecentWindow
from router.scaling.plan import Action, Layout, WorkerState, actions, fit_budget, role_of_pool
from router.scaling.policy import Planner, ScalingConfig, pressures
from router.scaling.signals import POOLS, Pool, pool_signals

if TYPE_CHECKING:
    from planner.sim.worker import SimWorker

__all__ = ["SimAutoscale", "SimAutoscaler", "SimFleet"]


@dataclass(frozen=True)
class SimAutoscale:
    """What ``kvrouter up --autoscale`` was given: the router's ``--scale-*`` objectives and
    timings, ``--max-workers``, ``--autoscale-interval``; and what the levers take
    (``settle_s``: a role change's settle, ``engine.worker.role``'s default; ``start_s``: a
    worker's start, assumed)."""

    scaling: ScalingConfig = field(default_factory=ScalingConfig)
    max_workers: int = 2
    interval_s: float = 2.0
    settle_s: float = 1.0
    start_s: float = 15.0

    def __post_init__(self) -> None:
        if self.max_workers < 1 or self.interval_s <= 0 or self.settle_s < 0 or self.start_s < 0:
            raise ValueError(f"bad autoscale settings: {self}")


class _Mode(Protocol):
    @property
    def mode(self) -> str: ...


class SimFleet(Protocol):
    """What the autoscaler drives (``planner.sim.cluster.SimCluster``): the virtual clock and
    its events, the workers by id, the router's mode (``config.mode``), a worker's removal."""

    @property
    def now(self) -> float: ...

    @property
    def config(self) -> _Mode: ...

    @property
    def workers(self) -> Mapping[str, SimWorker]: ...

    def at(self, t: float, fn: Callable[[], None]) -> None: ...

    def remove_worker(self, worker_id: str) -> None: ...


class SimAutoscaler:
    """The router's scaling evaluation and the launcher's rounds on ``cluster``'s clock (module
    docstring). ``cluster.autoscaler`` is set to it; the cluster calls :meth:`observe_itl`."""

    def __init__(self, cluster: SimFleet, spec: SimAutoscale,
                 new_worker: Callable[[str], SimWorker]) -> None:
        self.cluster, self.spec, self._new_worker = cluster, spec, new_worker
        clock = lambda: cluster.now  # noqa: E731
        mode = cluster.config.mode
        self.planner = Planner(spec.scaling, colocated_ok=mode == "auto", prefill_used=mode != "colocated")
        self.itl = RecentWindow(clock=clock)
        self._busy = {pool: RecentWindow(clock=clock) for pool in POOLS}
        self._decisions: dict[Pool, Any] = {}
        self._pressure: dict[Pool, float] = {}
        self._signals: dict[Pool, Any] = {}
        self._queue: list[Action] = []   # the plan being carried out, one action at a time
        self.timeline: list[dict[str, Any]] = []
        self.stopped = True
        self._gen = 0   # a restart's events replace an earlier run's

    def start(self) -> None:
        """Evaluate and act from now on (a workload starts)."""
        self.stopped = False
        self._gen += 1
        g = self._gen
        self.cluster.at(self.cluster.now, lambda: self._evaluate(g))
        self.cluster.at(self.cluster.now + self.spec.interval_s, lambda: self._round(g))

    def stop(self) -> None:
        """No more rounds (the workload is done); an action under way still completes."""
        self.stopped = True

    def observe_itl(self, gap_s: float) -> None:
        self.itl.add(gap_s)

    # --- the router ----------------------------------------------------------------------
    def _evaluate(self, gen: int) -> None:
        if self.stopped or gen != self._gen:
            return
        c = self.spec.scaling
        loads = [w.load for w in self.cluster.workers.values()]
        signals = pool_signals(loads, self.itl.mean(c.window_s))
        for pool in POOLS:
            s = signals[pool]
            if s.workers:
                self._busy[pool].add(s.prefilling / s.workers)
            signals[pool] = dataclasses.replace(s, prefill_busy=self._busy[pool].mean(c.window_s))
        self._signals = signals
        self._decisions = self.planner.evaluate(self.cluster.now, signals)
        self._pressure = pressures(signals, c)
        self.cluster.at(self.cluster.now + c.interval_s, lambda: self._evaluate(gen))

    # --- the launcher --------------------------------------------------------------------
    def layout(self) -> Layout:
        ws = self.cluster.workers.values()
        return Layout(sum(w.spec.role == "prefill" for w in ws), sum(w.spec.role != "prefill" for w in ws))

    def _round(self, gen: int) -> None:
        if self.stopped or gen != self._gen:
            return
        now = self.cluster.now
        self.cluster.at(now + self.spec.interval_s, lambda: self._round(gen))
        if self._queue or not self._decisions:
            return
        layout = self.layout()
        self.timeline.append({"kind": "signals", "t": now, "layout": str(layout), "prefill": layout.prefill,
                              "decode": layout.decode, "pools": {p: {
                                  "pressure": round(self._pressure[p], 4), "desired": self._decisions[p].desired,
                                  "workers": self._signals[p].workers} for p in POOLS}})
        desired: dict[Pool, int] = {p: int(self._decisions[p].desired) for p in POOLS}
        min_prefill = 0 if self.cluster.config.mode == "auto" else 1
        target = fit_budget(layout, desired, self._pressure, self.spec.max_workers, min_prefill)
        states = [WorkerState(w.worker_id, "prefill" if w.spec.role == "prefill" else "decode", w.load.load)
                  for w in self.cluster.workers.values()]
        self._queue = actions(states, target)
        if self._queue:
            self._next(layout, target)

    def _next(self, before: Layout, target: Layout) -> None:
        if not self._queue:
            return
        action = self._queue[0]
        t0 = self.cluster.now
        role = role_of_pool(action.to)

        def done(worker: str | None) -> None:
            self.timeline.append({"kind": "action", "action": action.kind, "worker": worker, "to": role,
                                  "started": t0, "t": self.cluster.now, "seconds": self.cluster.now - t0,
                                  "layout_before": str(before), "target": str(target),
                                  "layout_after": str(self.layout())})
            self._queue.pop(0)
            self._next(before, target)

        if action.kind == "start":
            self.cluster.at(t0 + self.spec.start_s, lambda: done(self._new_worker(role).worker_id))
            return
        assert action.worker is not None
        w = self.cluster.workers[action.worker]
        if action.kind == "role" and not needs_drain(w.spec.role, role):
            w.set_role(role)
            done(w.worker_id)
            return
        w.set_draining(True)
        deadline = t0 + self.spec.settle_s

        def check() -> None:
            if self.cluster.now >= deadline and not w.phases:
                w.set_draining(False)
                if action.kind == "role":
                    w.set_role(role)
                    w.wake(self.cluster.now)
                else:
                    self.cluster.remove_worker(w.worker_id)
                done(w.worker_id)
            else:
                self.cluster.at(max(self.cluster.now + 0.05, deadline), check)

        self.cluster.at(deadline, check)
