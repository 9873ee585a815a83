"""A worker's role, changed at run time (``POST /role``), drained first.

Every worker can run every phase; its role only says what the router sends it
(``WorkerInfo.can_prefill`` / ``can_decode``). So moving capacity between the prefill and the
decode pool is a role change, not a restart. A change from ``old`` to ``new``:

1. **draining**: the registration is rewritten with ``"draining": true`` (still ``old``), and
   :meth:`RoleChanger.change` returns once etcd has it. A router's pool keeps a draining
   worker (its event stream, its books, the streams of its requests) but puts it in no pool,
   so no new request of either kind is sent to it (``router.workers.pool``).
2. **the drain**: the requests it holds run to their end here, and so do any that a router
   sent before its view had the flag (they are accepted: refusing them would only turn them
   into failovers). The drain ends once ``settle_s`` has passed since the flag was published
   (a router's view follows etcd's watch well within it) and no request is in flight.
3. **the new role**: ``apply(new)`` (what the worker saves to the store follows the role,
   ``WorkerConfig.saves_all_as``), then the registration says ``new``, not draining; the
   router's pool updates the worker in place and sends it the new role's work.

A drain that outlasts ``timeout_s`` completes anyway (``timed_out`` in :attr:`last`): a role
never stops a request, it only says where new ones go. A change to ``colocated``, which takes
every phase the old role took, needs no drain: it takes effect at once. One change at a time:
another target while one runs is :class:`RoleBusy`; the same target again is the same
change. A failed publish (etcd unreachable) leaves the old role registered and serving, and
raises :class:`RolePublishError`.

Everything here runs on the server's event loop; ``publish`` (a blocking etcd put) runs on
a thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.api.generate import WORKER_ROLES, WorkerInfo, WorkerRole

__all__ = ["RoleBusy", "RoleChanger", "RoleChange", "RolePublishError", "needs_drain"]

log = logging.getLogger(__name__)

_PHASES: dict[str, frozenset[str]] = {   # what the router sends a worker of each role
    "prefill": frozenset({"prefill"}),
    "decode": frozenset({"decode", "full"}),
    "colocated": frozenset({"prefill", "decode", "full"}),
}


def needs_drain(old: WorkerRole, new: WorkerRole) -> bool:
    """Whether going from ``old`` to ``new`` stops some kind of work ``old`` was sent."""
    return not _PHASES[old] <= _PHASES[new]


class RoleBusy(RuntimeError):
    """Another role change is under way; wait for it (``GET /role``) and ask again."""


class RolePublishError(RuntimeError):
    """The registration could not be rewritten (etcd unreachable): nothing changed."""


@dataclass(frozen=True)
class RoleChange:
    """One finished change: from, to, how long its drain took, whether it timed out."""

    old: WorkerRole
    new: WorkerRole
    drain_s: float
    timed_out: bool
    finished_unix: float

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class RoleChanger:
    """The worker's current role and the change under way (module docstring).

    ``info``: the worker's registration as it is now; ``publish(info)``: rewrite the etcd
    value (blocking; None: the worker is not registered); ``apply(role)``: make the engine
    behave as ``role``; ``in_flight()``: requests accepted and not finished."""

    def __init__(self, info: WorkerInfo, *, in_flight: Callable[[], int],
                 publish: Callable[[WorkerInfo], None] | None = None,
                 apply: Callable[[WorkerRole], None] | None = None,
                 settle_s: float = 1.0, timeout_s: float = 300.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.info = info
        self.publish = publish
        self._apply = apply or (lambda role: None)
        self._in_flight = in_flight
        self.settle_s, self.timeout_s = settle_s, timeout_s
        self._clock = clock
        self.target: WorkerRole | None = None
        self._since = 0.0
        self._task: asyncio.Task[None] | None = None
        self.last: RoleChange | None = None
        self.changes = 0
        self._lock = asyncio.Lock()

    @property
    def role(self) -> WorkerRole:
        return self.info.role

    @property
    def draining(self) -> bool:
        return self.target is not None

    def state(self) -> dict[str, Any]:
        """``GET /role``'s body."""
        return {"role": self.role, "target": self.target,
                "state": "draining" if self.draining else "serving",
                "in_flight": self._in_flight(),
                "draining_s": round(self._clock() - self._since, 3) if self.draining else None,
                "changes": self.changes, "last": self.last.to_json() if self.last else None}

    async def change(self, new: WorkerRole) -> dict[str, Any]:
        """Start changing to ``new`` (returns once the router can know); see the module
        docstring. The state after the call is returned."""
        if new not in WORKER_ROLES:
            raise ValueError(f"role must be one of {list(WORKER_ROLES)}, got {new!r}")
        async with self._lock:   # one caller at a time past here: a second sees the first's target
            if self.target is not None:
                if new == self.target:
                    return self.state()
                raise RoleBusy(f"changing to {self.target!r} already ({self._in_flight()} request(s) "
                               "still running); ask again when GET /role says serving")
            if new == self.role:
                return self.state()
            old = self.role
            if not needs_drain(old, new):
                await self._publish(dataclasses.replace(self.info, role=new, draining=False))
                self._apply(new)
                self._finished(old, new, 0.0, False)
                return self.state()
            await self._publish(dataclasses.replace(self.info, draining=True))
            self.target, self._since = new, self._clock()
            log.warning("role change %s -> %s: draining (%d request(s) in flight)", old, new,
                        self._in_flight())
            self._task = asyncio.create_task(self._drain(old, new), name=f"role:{old}->{new}")
            return self.state()

    async def wait(self) -> None:
        """Until no change is under way."""
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(self._task)

    async def cancel(self) -> None:
        """Stop waiting for a drain (the worker is shutting down); the role stays as it is."""
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self.target = None

    async def _publish(self, info: WorkerInfo) -> None:
        if self.publish is not None:
            try:
                await asyncio.to_thread(self.publish, info)
            except Exception as exc:  # EtcdError and transport errors alike
                raise RolePublishError(f"could not register {info.role!r}"
                                       f"{' (draining)' if info.draining else ''} in etcd: {exc}") from exc
        self.info = info

    async def _drain(self, old: WorkerRole, new: WorkerRole) -> None:
        start = self._since
        timed_out = False
        while True:
            now = self._clock()
            if now - start >= self.settle_s and self._in_flight() == 0:
                break
            if now - start >= self.timeout_s:
                timed_out = True
                log.warning("role change %s -> %s: %d request(s) still running after %.0f s; "
                            "changing anyway (they go on)", old, new, self._in_flight(), self.timeout_s)
                break
            await asyncio.sleep(0.02)
        self._apply(new)
        final = dataclasses.replace(self.info, role=new, draining=False)
        while True:   # the drain is done: keep trying to say so (etcd may be away a while)
            try:
                await self._publish(final)
                break
            except RolePublishError as exc:
                log.warning("%s; retrying in 1 s", exc)
                await asyncio.sleep(1.0)
        self.target = None
        self._task = None
        self._finished(old, new, self._clock() - start, timed_out)

    def _finished(self, old: WorkerRole, new: WorkerRole, drain_s: float, timed_out: bool) -> None:
        self.changes += 1
        self.last = RoleChange(old, new, round(drain_s, 3), timed_out, time.time())
        print(f"kvengine role worker_id={self.info.worker_id} role={new} previous={old} "
              f"drain_s={drain_s:.2f}{' timed_out' if timed_out else ''}", flush=True)
