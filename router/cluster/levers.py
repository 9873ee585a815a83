"""What an autoscaler can do to a :class:`~router.cluster.launcher.LocalCluster`, one lever each.

All calls block (they run on the autoscaler's thread) and return how long they took:

- :meth:`Levers.change_role`: ``POST /role`` on the worker (with the cluster secret and its
  worker id, as the router calls it), then ``GET /role`` until the change took effect (the
  worker drains first: ``engine.worker.role``). The child's command line gets the new
  ``--role``, so a supervisor's restart brings it back in the role it has now, and its
  ``kind`` (``cluster.json``) says it;
- :meth:`Levers.start`: a worker of ``role``, ready by its own ready line: a worker the
  cluster stopped before is started again in place (same name and port), else a new one
  (``LocalCluster.add_worker``);
- :meth:`Levers.stop`: ``LocalCluster.stop_child`` (marked deliberate: a supervisor leaves it
  stopped) with a timeout long enough for its drain (SIGTERM: it says "draining" in etcd, so
  routers send it nothing more, then finishes what it holds).

A wait that the autoscaler's ``cancelled()`` ends raises :class:`LeverCancelled`; one past
its timeout raises :class:`LeverFailed` naming the worker and what it last said.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx

from engine.api.generate import WORKER_ID_HEADER
from kvstore.secret import bearer_headers
from router.cluster.child import ChildProcess
from router.cluster.launcher import LocalCluster

__all__ = ["Levers", "LeverFailed", "LeverCancelled", "WORKER_KINDS"]

WORKER_KINDS = frozenset({"prefill", "decode", "colocated"})


class LeverFailed(RuntimeError):
    """A lever did not take effect in time; the message says which worker and why."""


class LeverCancelled(RuntimeError):
    """The autoscaler is stopping; the lever's wait was abandoned."""


class Levers:
    """The levers on ``cluster`` (module docstring)."""

    def __init__(self, cluster: LocalCluster, *, role_timeout_s: float = 600.0,
                 stop_timeout_s: float = 300.0, ready_timeout_s: float | None = None,
                 cancelled: Callable[[], bool] = lambda: False) -> None:
        self.cluster = cluster
        self.role_timeout_s, self.stop_timeout_s = role_timeout_s, stop_timeout_s
        self.ready_timeout_s = ready_timeout_s or cluster.spec.ready_timeout
        self.cancelled = cancelled
        tls = cluster.spec.tls
        self._http = httpx.Client(timeout=10.0, trust_env=False,
                                  verify=tls.client_context() if tls is not None else True)

    def close(self) -> None:
        self._http.close()

    def _headers(self, child: ChildProcess) -> dict[str, str]:
        return {**bearer_headers(self.cluster.secret), WORKER_ID_HEADER: child.member_id or ""}

    def _wait(self, what: str, timeout: float, done: Callable[[], bool]) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            if self.cancelled():
                raise LeverCancelled(what)
            if time.monotonic() > deadline:
                raise LeverFailed(f"{what}: not done after {timeout:.0f} s")
            time.sleep(0.2)

    def change_role(self, name: str, role: str) -> float:
        """Change worker ``name`` to ``role`` (module docstring); the seconds it took."""
        child = self.cluster.child(name)
        t0 = time.monotonic()
        url = f"{child.address}/role"
        resp = self._http.post(url, json={"role": role}, headers=self._headers(child))
        if resp.status_code not in (200, 202):
            raise LeverFailed(f"{name}: POST /role answered {resp.status_code}: {resp.text[:300]}")
        last: dict[str, object] = resp.json()

        def changed() -> bool:
            nonlocal last
            try:
                last = self._http.get(url, headers=self._headers(child)).json()
            except (httpx.HTTPError, ValueError) as exc:
                if not child.alive():
                    raise LeverFailed(f"{name} exited while changing its role: {exc}") from exc
                return False
            return last.get("role") == role and last.get("state") == "serving"
        try:
            self._wait(f"{name}'s role change to {role}", self.role_timeout_s, changed)
        except LeverFailed as exc:
            raise LeverFailed(f"{exc}; it last said {last}") from None
        child.argv[child.argv.index("--role") + 1] = role   # a restart comes back as it is now
        child.kind = role
        self.cluster.write_state()
        return time.monotonic() - t0

    def start(self, role: str) -> tuple[str, float]:
        """Start a worker of ``role`` (module docstring); its name and the seconds it took."""
        t0 = time.monotonic()
        stopped = [c for c in self.cluster.children
                   if c.kind in WORKER_KINDS and c.deliberate and not c.alive()]
        if stopped:
            child = stopped[0]
            child.argv[child.argv.index("--role") + 1] = role
            child.kind = role
            self.cluster.respawn(child)
        else:
            child = self.cluster.add_worker(role)
        self.cluster.on_status(f"{child.name}: starting as a {role} worker (pid {child.pid})")

        def ready() -> bool:
            if not child.alive():
                raise LeverFailed(f"{child.name} exited with {child.returncode} while starting; "
                                  f"last lines of {child.log_path}:\n{child.log_tail()}")
            return self.cluster.is_ready(child)
        self._wait(f"{child.name}'s start as {role}", self.ready_timeout_s, ready)
        self.cluster.worker_urls[child.name] = child.address
        self.cluster.write_state()
        return child.name, time.monotonic() - t0

    def stop(self, name: str) -> float:
        """Stop worker ``name`` for good (module docstring); the seconds its drain took."""
        t0 = time.monotonic()
        self.cluster.stop_child(name, timeout=self.stop_timeout_s)
        return time.monotonic() - t0
