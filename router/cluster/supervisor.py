"""Keeps a started :class:`~router.cluster.launcher.LocalCluster` alive: every child that exits
unexpectedly is restarted, with backoff, while the rest keeps serving.

``Supervisor(cluster, on_status).poll()`` does one round; ``kvrouter up`` calls it twice a
second until Ctrl-C or SIGTERM (the only things that stop the cluster). Per child:

- running, then it exits: an *unexpected exit* unless the cluster stopped it itself
  (``LocalCluster.stop_child``, the ``deliberate`` mark): logged on the console with its exit
  code and log, counted (``kvrouter_up_child_exits_total``), and a restart is due after the
  child's backoff;
- the restart (``LocalCluster.respawn``: same command, port and environment, the log
  appended to) is counted (``kvrouter_up_child_restarts_total``); it is back when its own
  ready line says so (``LocalCluster.is_ready``), reported with the seconds since it exited;
- backoff: ``base_delay`` (0.25 s) before the first restart, doubled after every restart that
  did not stay up ``stable_after`` (20 s), at most ``max_delay`` (15 s). A child that never
  comes up is retried forever at ``max_delay``, the console says so each time;
- a deliberate stop is left stopped: ``stopped`` in ``cluster.json``, no restart; a child
  the cluster starts again itself (an autoscaler's start of a worker it had stopped) is
  watched again from then on.

Every change rewrites the cluster's ``cluster.json`` (each child's state: running,
restarting, starting, stopped). The metrics live in a registry of the supervisor's own;
:func:`serve_metrics` exports it on a port of the launcher's own (``kvrouter up
--metrics-port``): the router is a child that may itself be the one restarting.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from router.cluster.child import ChildProcess
from router.cluster.launcher import LocalCluster

__all__ = ["Supervisor", "SupervisorMetrics", "serve_metrics"]


class SupervisorMetrics:
    """The launcher's collectors, in a registry of their own."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        labels = ["child", "kind"]
        self.exits = Counter("kvrouter_up_child_exits", "Unexpected exits of a child of kvrouter up",
                             labels, registry=r)
        self.restarts = Counter("kvrouter_up_child_restarts", "Restarts of a child by kvrouter up",
                                labels, registry=r)
        self.up = Gauge("kvrouter_up_child_up", "1 while the child is running and ready", labels,
                        registry=r)
        self.back_seconds = Gauge("kvrouter_up_child_back_seconds",
                                  "Seconds from the child's last unexpected exit to its replacement ready",
                                  labels, registry=r)


def serve_metrics(metrics: SupervisorMetrics, port: int, host: str = "127.0.0.1") -> tuple[str, Callable[[], None]]:
    """Serve ``/metrics`` of ``metrics`` on ``host:port`` (0: a free port) on a thread;
    returns its URL and a function that stops it."""
    server, thread = start_http_server(port, addr=host, registry=metrics.registry)
    bound = server.server_address[1]

    def close() -> None:
        server.shutdown()
        server.server_close()
        thread.join(timeout=2.0)
    return f"http://{host}:{bound}/metrics", close


@dataclass
class _Watch:
    """What the supervisor knows of one child."""

    state: str = "running"          # running | restarting | starting | stopped
    delay: float = 0.0              # the backoff before the next restart
    due: float = 0.0                # monotonic time of the next restart
    exited_at: float = 0.0          # monotonic time of the unexpected exit being repaired
    ready_at: float = 0.0           # monotonic time this start became ready


class Supervisor:
    """Restarts what exits unexpectedly (module docstring); ``poll()`` never blocks long."""

    def __init__(self, cluster: LocalCluster, on_status: Callable[[str], None] | None = None, *,
                 metrics: SupervisorMetrics | None = None, base_delay: float = 0.25,
                 max_delay: float = 15.0, stable_after: float = 20.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cluster = cluster
        self.say = on_status or (lambda line: None)
        self.metrics = metrics or SupervisorMetrics()
        self.base_delay, self.max_delay, self.stable_after = base_delay, max_delay, stable_after
        self.clock = clock
        now = clock()
        self._watch = {c.name: _Watch(delay=base_delay, ready_at=now) for c in cluster.children}
        for c in cluster.children:
            self._labels(c)
            self.metrics.up.labels(c.name, c.kind).set(1 if c.alive() else 0)

    def _labels(self, child: ChildProcess) -> None:  # every series shows from the start, at 0
        for m in (self.metrics.exits, self.metrics.restarts, self.metrics.back_seconds):
            m.labels(child.name, child.kind)

    def states(self) -> dict[str, str]:
        return {name: w.state for name, w in self._watch.items()}

    def poll(self) -> None:
        """One round over every child."""
        changed = False
        for child in list(self.cluster.children):
            w = self._watch.setdefault(child.name, _Watch(delay=self.base_delay, ready_at=self.clock()))
            changed |= self._step(child, w)
        if changed:
            self.cluster.write_state(self.states())

    def _step(self, child: ChildProcess, w: _Watch) -> bool:
        now = self.clock()
        up = self.metrics.up.labels(child.name, child.kind)
        if w.state == "stopped":
            if child.alive() and not child.deliberate:   # the cluster started it again itself
                w.state, w.ready_at, w.delay = "running", now, self.base_delay
                up.set(1)
                return True
            return False
        if not child.alive() and w.state in ("running", "starting"):
            up.set(0)
            if child.deliberate:
                w.state = "stopped"
                self.say(f"{child.name} stopped on request; not restarted")
                return True
            if w.state == "running":
                if now - w.ready_at >= self.stable_after:
                    w.delay = self.base_delay      # it had been up a while: a fresh failure
                w.exited_at = now
            self.metrics.exits.labels(child.name, child.kind).inc()
            w.state, w.due = "restarting", now + w.delay
            self.say(f"{child.name} (pid {child.pid}) exited unexpectedly with code {child.returncode}; "
                     f"restarting in {w.delay:.2f} s; its log: {child.log_path}")
            w.delay = min(max(w.delay, self.base_delay) * 2, self.max_delay)
            return True
        if w.state == "restarting" and now >= w.due:
            if child.deliberate:
                w.state = "stopped"
                return True
            self.cluster.respawn(child)
            self.metrics.restarts.labels(child.name, child.kind).inc()
            w.state = "starting"
            self.say(f"{child.name} restarted (pid {child.pid}, start {child.starts})")
            return True
        if w.state == "starting" and self.cluster.is_ready(child):
            w.state, w.ready_at = "running", now
            up.set(1)
            back = now - w.exited_at
            self.metrics.back_seconds.labels(child.name, child.kind).set(back)
            who = f", id {child.member_id}" if child.member_id else ""
            self.say(f"{child.name} back (pid {child.pid}{who}) {back:.1f} s after it exited")
            return True
        return False
