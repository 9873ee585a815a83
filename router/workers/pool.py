"""The live set of workers the router can use, fed by etcd membership.

``WorkerPool.from_etcd(url, cluster)`` watches ``/{cluster}/workers/`` with
``kvstore.coord.membership.Membership``. For every member it keeps a :class:`WorkerHandle`: the
parsed :class:`WorkerInfo`, a :class:`WorkerClient`, the :class:`WorkerLoad` the policies read,
and a task following the worker's event stream into the shared :class:`KvIndex`.

- A worker that registers is usable as soon as the watch reports it (the watch thread wakes
  the pool's loop; a poll every ``poll_interval`` backs it up): well within a second.
- A worker that joins starts from its peers' learned costs (``peer_priors``), not the generic
  priors, so a restarted or added worker is not starved by peers priced at what they measured.
- A worker whose key disappears (closed, or its lease expired) is dropped: its event task is
  cancelled, its blocks leave the index, its client is closed.
- A member whose value changes (a restart at a new address) is replaced; one whose value
  changes only in ``role`` or ``draining`` (``POST /role`` on the worker: the same process)
  is updated in place, so its event stream, its books and the streams of its requests go on.
- A draining worker (``WorkerInfo.draining``: it is changing its role and finishes what it
  holds first) is in no pool: ``prefill_workers`` and ``decode_workers`` leave it out, so it
  gets no new work, while ``workers()`` still lists it.
- A member that joins at the address of one already held supersedes it: one port is one
  process, so the old registration is a killed worker's, kept alive by its lease until the
  TTL ends, now pointing at its replacement. The old one is dropped at once (were both kept,
  a failover from one to the other would send one request to one process twice; the worker
  also answers 421 to calls meant for another id, ``router.workers.client``).
- When etcd is unreachable the membership keeps its last view, the pool keeps serving with
  it, and ``etcd_healthy`` / ``health()`` say so.

``StaticMembership`` is the same interface over a fixed list (no etcd): for colocated setups
and tests. Everything here runs on one asyncio loop; only ``_wake`` crosses threads.

A member whose ``WorkerInfo.engine`` is ``vllm`` (a vLLM server, registered by the store's KV
connector) gets a ``router.workers.vllm_client.VllmWorkerClient`` instead, its index fed from
vLLM's ZMQ KV events at ``info.kv_events``: the rest of the router drives it as one of ours.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from engine.api.generate import ApiValidationError, WorkerInfo
from router.workers.client import WorkerClient
from router.workers.fit import RateConfig
from router.workers.kv_index import KvIndex
from router.workers.load import WorkerLoad, peer_priors

__all__ = ["MembershipSource", "StaticMembership", "WorkerHandle", "WorkerPool"]

log = logging.getLogger(__name__)


class MembershipSource(Protocol):
    """What the pool needs of a membership (``kvstore.coord.membership.Membership`` has it)."""

    def start(self) -> Any: ...
    def members(self) -> dict[str, dict[str, Any]]: ...
    @property
    def healthy(self) -> bool: ...
    def close(self) -> None: ...


class StaticMembership:
    """A fixed member list: ``{worker_id: etcd-style value}``; always healthy."""

    def __init__(self, workers: Iterable[WorkerInfo]) -> None:
        self._members = {w.worker_id: w.to_etcd_value() for w in workers}

    def start(self) -> StaticMembership:
        return self

    def members(self) -> dict[str, dict[str, Any]]:
        return dict(self._members)

    @property
    def healthy(self) -> bool:
        return True

    def close(self) -> None:
        pass


@dataclass(eq=False)
class WorkerHandle:
    """One usable worker."""

    info: WorkerInfo
    client: WorkerClient
    load: WorkerLoad
    events_task: asyncio.Task[None]

    @property
    def worker_id(self) -> str:
        return self.info.worker_id


class WorkerPool:
    """Workers discovered from a :class:`MembershipSource` (see the module docstring)."""

    def __init__(self, source: MembershipSource | None = None, *, index: KvIndex | None = None,
                 rates: RateConfig | None = None, poll_interval: float = 0.25,
                 client_timeout: float = 5.0, headers: Mapping[str, str] | None = None) -> None:
        self.index = index if index is not None else KvIndex()
        self._source = source
        self._rates = rates or RateConfig()
        self._poll_interval = poll_interval
        self._closing = False
        self._client_timeout = client_timeout
        self._headers = dict(headers or {})     # on every worker call: the cluster secret
        self._workers: dict[str, WorkerHandle] = {}
        self._values: dict[str, Mapping[str, Any]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._changed: asyncio.Condition | None = None

    @classmethod
    def from_etcd(cls, etcd: str, cluster: str, **kwargs: Any) -> WorkerPool:
        """A pool watching ``/{cluster}/workers/`` on the etcd at ``etcd`` (a URL)."""
        from kvstore.coord import layout
        from kvstore.coord.membership import Membership

        pool = cls(**kwargs)
        pool._source = Membership(etcd, layout.workers_prefix(cluster),
                                  on_change=lambda _c: pool._notify())
        return pool

    # --- lifecycle ------------------------------------------------------------------------

    async def start(self) -> WorkerPool:
        """Read the membership (raises if etcd cannot be reached now) and start watching."""
        if self._source is None:
            raise RuntimeError("WorkerPool needs a membership source (use WorkerPool.from_etcd)")
        if self._task is not None:
            raise RuntimeError("WorkerPool already started")
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._changed = asyncio.Condition()
        await asyncio.to_thread(self._source.start)
        await self._sync()
        self._task = asyncio.create_task(self._run(), name="worker-pool")
        return self

    async def close(self) -> None:
        """Stop watching, cancel every event task, close every client. Idempotent."""
        if self._task is not None:
            # Ask the loop to end at its next wake-up rather than cancel it: a cancellation that
            # lands while wait_for is cancelling its own timed-out wait can be lost (Python
            # 3.11), which left close() waiting for as long as 30 s.
            self._closing = True
            if self._wake is not None:
                self._wake.set()
            done, _ = await asyncio.wait([self._task], timeout=5.0)
            if not done:  # a sync stuck on something: cancel it after all
                self._task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._task
            self._task = None
        for wid in list(self._workers):
            await self._drop(wid)
        if self._source is not None:
            await asyncio.to_thread(self._source.close)

    # --- the view -------------------------------------------------------------------------

    def workers(self) -> list[WorkerHandle]:
        return list(self._workers.values())

    def get(self, worker_id: str) -> WorkerHandle | None:
        return self._workers.get(worker_id)

    def prefill_workers(self, model: str | None = None) -> list[WorkerHandle]:
        return [w for w in self._workers.values() if w.info.can_prefill and not w.info.draining
                and (model is None or w.info.model == model)]

    def decode_workers(self, model: str | None = None) -> list[WorkerHandle]:
        return [w for w in self._workers.values() if w.info.can_decode and not w.info.draining
                and (model is None or w.info.model == model)]

    def models(self) -> dict[str, WorkerInfo]:
        """Served model name → one of its workers' info (namespace, block size, context)."""
        out: dict[str, WorkerInfo] = {}
        for w in sorted(self._workers.values(), key=lambda h: h.worker_id):
            out.setdefault(w.info.model, w.info)
        return out

    @property
    def etcd_healthy(self) -> bool:
        return self._source is not None and self._source.healthy

    def health(self) -> dict[str, Any]:
        """For ``/health``: membership source state and the workers by role."""
        roles: dict[str, int] = {}
        for w in self._workers.values():
            roles[w.info.role] = roles.get(w.info.role, 0) + 1
        return {
            "membership": "ok" if self.etcd_healthy
            else "etcd unreachable: serving with the last known membership",
            "workers": len(self._workers),
            "roles": roles,
            "draining": sum(w.info.draining for w in self._workers.values()),
            "synced": sum(self.index.is_synced(wid) for wid in self._workers),
        }

    async def wait_for(self, predicate: Any, timeout: float) -> bool:
        """Wait until ``predicate(pool)`` holds (re-checked on every change); False on timeout."""
        changed = self._changed
        assert changed is not None, "start() first"

        async def waiter() -> None:
            async with changed:
                await changed.wait_for(lambda: predicate(self))

        try:
            await asyncio.wait_for(waiter(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    # --- syncing --------------------------------------------------------------------------

    def _notify(self) -> None:
        """Called from the membership's watch thread."""
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None and not loop.is_closed():
            loop.call_soon_threadsafe(wake.set)

    async def _run(self) -> None:
        assert self._wake is not None
        while not self._closing:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self._poll_interval)
            self._wake.clear()
            if self._closing:
                return
            try:
                await self._sync()
            except Exception:  # never let one bad sync stop discovery
                log.exception("worker pool sync failed")

    async def _sync(self) -> None:
        assert self._source is not None and self._changed is not None
        members = self._source.members()
        changed = False
        held = set(self._workers)      # before this sync: who a newcomer can supersede
        for wid in [w for w in self._values if w not in members and w not in self._workers]:
            del self._values[wid]  # a bad registration that left
        for wid in [w for w in self._workers if w not in members]:
            log.info("worker %s left", wid)
            await self._drop(wid)
            changed = True
        for wid, value in members.items():
            if self._values.get(wid) == value:
                continue
            if wid in self._workers and self._update_in_place(wid, value):
                changed = True
                continue
            if wid in self._workers:
                log.info("worker %s changed; reconnecting", wid)
                await self._drop(wid)
            self._values[wid] = value
            try:
                info = WorkerInfo.from_etcd_value(wid, value)
            except ApiValidationError as exc:
                log.warning("ignoring worker %s: bad registration (%s)", wid, exc)
                continue
            for old in [w for w, h in self._workers.items()
                        if w in held and w != wid and h.info.address == info.address]:
                log.info("worker %s superseded by %s at %s", old, wid, info.address)
                await self._drop(old)
                self._values[old] = members[old]   # a stale key: not added back while it lasts
            self._add(info)
            changed = True
        if changed:
            async with self._changed:
                self._changed.notify_all()

    def _update_in_place(self, worker_id: str, value: Mapping[str, Any]) -> bool:
        """A held worker's new value that differs in ``role`` or ``draining`` only: the same
        process changing its role. Its handle takes the new info; True if so."""
        handle = self._workers[worker_id]
        try:
            info = WorkerInfo.from_etcd_value(worker_id, value)
        except ApiValidationError:
            return False
        if dataclasses.replace(handle.info, role=info.role, draining=info.draining) != info:
            return False
        log.info("worker %s is now %s%s", worker_id, info.role, " (draining)" if info.draining else "")
        self._values[worker_id] = value
        handle.info = handle.load.info = handle.client.info = info
        return True

    def _client(self, info: WorkerInfo) -> WorkerClient:
        """Our worker's API, or a vLLM server's (``info.engine``) with its KV events followed."""
        if info.engine != "vllm":
            return WorkerClient(info, timeout=self._client_timeout, headers=self._headers)
        from router.workers.vllm_client import VllmWorkerClient, zmq_kv_events

        events = zmq_kv_events(info, info.kv_events, info.kv_events_replay) if info.kv_events else None
        return VllmWorkerClient(info, timeout=self._client_timeout, headers=self._headers, events=events)

    def _add(self, info: WorkerInfo) -> None:
        client = self._client(info)
        peers = (h.load for h in self._workers.values() if h.info.namespace == info.namespace)
        load = WorkerLoad(info, peer_priors(self._rates, peers))
        self.index.add_worker(info.worker_id)
        task = asyncio.create_task(client.follow_events(self.index, load.observe_load),
                                   name=f"events:{info.worker_id}")
        self._workers[info.worker_id] = WorkerHandle(info, client, load, task)
        log.info("worker %s joined (%s at %s)", info.worker_id, info.role, info.address)

    async def _drop(self, worker_id: str) -> None:
        self._values.pop(worker_id, None)
        handle = self._workers.pop(worker_id, None)
        if handle is None:
            return
        handle.events_task.cancel()
        # asyncio.wait, not ``await task`` under suppress(CancelledError): that would also
        # swallow a cancellation of the task running this (close() cancelling a sync), which
        # then ran on until its next wake-up.
        await asyncio.wait([handle.events_task])
        self.index.remove_worker(worker_id)
        await handle.client.aclose()
