"""The KV store as the router sees it: prefix lookups, and whether it is up.

:class:`StoreView` wraps the router's store client (a ``kvstore`` ``Client`` for one node or a
``ClusterClient`` over the nodes in etcd, built by ``connect``):

- ``prefix_len(keys)`` (blocking; placement runs it on a thread) asks the store how many
  leading blocks it holds. A failure marks the store down and is raised on: placement
  counts it as "no hit" ("a store failure is a miss").
- A probe every ``probe_interval`` seconds (the store's ``stats``, on a thread) marks it up or
  down and names each node; a client that could not be built at start-up is built again by
  the probe, so a store started after the router is found.
- ``up``: True, False, or None before the first answer. ``health()`` is ``/health``'s
  ``store`` entry.

Placement reads ``up`` to decide whether a request can be disaggregated at all: a prefill
worker hands its KV over through the store, so with the store down the request is prefilled
where it decodes (``router.placement.route.Route.STORE_DOWN``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from kvstore.errors import StoreUnavailable

__all__ = ["StoreView", "StoreLookup"]

log = logging.getLogger(__name__)


class StoreLookup(Protocol):
    """What the router needs of a store client (``kvstore.Client`` / ``ClusterClient``)."""

    def prefix_len(self, keys: Sequence[bytes]) -> int: ...
    def stats(self) -> dict[str, Any]: ...
    def close(self) -> None: ...


class StoreView:
    """See the module docstring. ``connect()`` builds the client (raises when it cannot)."""

    def __init__(self, connect: Callable[[], StoreLookup], *, probe_interval: float = 1.0,
                 where: str = "the store") -> None:
        self._connect = connect
        self._interval = probe_interval
        self.where = where
        self._lock = threading.Lock()
        self._client: StoreLookup | None = None
        self._up: bool | None = None
        self._detail = "not probed yet"
        self._nodes: dict[str, dict[str, Any]] = {}
        self._since = time.monotonic()
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._client_or_none()

    # --- state ----------------------------------------------------------------------------

    @property
    def up(self) -> bool | None:
        return self._up

    def health(self) -> dict[str, Any]:
        status = {True: "ok", False: "down", None: "unknown"}[self._up]
        return {"status": status, "where": self.where, "detail": self._detail,
                "since_s": round(time.monotonic() - self._since, 3), "nodes": dict(self._nodes)}

    def _mark(self, up: bool, detail: str, nodes: dict[str, dict[str, Any]] | None = None) -> None:
        if up != self._up:
            (log.info if up else log.warning)("store %s (%s)", "up" if up else "down", detail)
            self._since = time.monotonic()
        self._up, self._detail = up, detail
        if nodes is not None:
            self._nodes = nodes

    # --- calls ----------------------------------------------------------------------------

    def prefix_len(self, keys: Sequence[bytes]) -> int:
        client = self._client_or_none()
        if client is None:
            raise StoreUnavailable(f"no store client for {self.where}: {self._detail}")
        try:
            return client.prefix_len(keys)
        except Exception as exc:
            self._mark(False, f"a prefix lookup failed: {exc}")
            raise

    def probe(self) -> bool:
        """Ask the store now (blocking); True when it answered."""
        client = self._client_or_none()
        if client is None:
            return False
        try:
            stats = client.stats()
        except Exception as exc:  # noqa: BLE001 - any failure is "down", said in the detail
            self._mark(False, str(exc), {})
            return False
        raw = stats.get("nodes")
        if isinstance(raw, dict):     # a ClusterClient: one entry per node registered in etcd
            nodes = {str(n): {"address": v.get("address"), "status": "ok" if "stats" in v else "down",
                              **({"error": v["error"]} if "error" in v else {})}
                     for n, v in raw.items() if isinstance(v, dict)}
            live = sum(v["status"] == "ok" for v in nodes.values())
            if not nodes:
                self._mark(False, "no store node is registered in etcd", nodes)
            elif not live:
                self._mark(False, "no registered store node answers", nodes)
            else:
                self._mark(True, f"{live} of {len(nodes)} store nodes answer", nodes)
            return bool(live)
        server = stats.get("server")
        server = server if isinstance(server, dict) else {}
        node = str(server.get("node_id") or self.where)
        self._mark(True, "answers", {node: {"address": server.get("address", self.where),
                                            "status": "ok"}})
        return True

    def _client_or_none(self) -> StoreLookup | None:
        with self._lock:
            if self._client is not None or self._closed:
                return self._client
            try:
                self._client = self._connect()
            except Exception as exc:  # noqa: BLE001 - routing goes on without the store
                self._mark(False, f"cannot connect: {exc}", {})
            return self._client

    # --- lifecycle (on the serving loop) ---------------------------------------------------

    async def start(self) -> StoreView:
        await asyncio.to_thread(self.probe)
        self._task = asyncio.create_task(self._run(), name="store-probe")
        return self

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            await asyncio.to_thread(self.probe)

    def close(self) -> None:
        """Close the client (after ``stop``). Idempotent."""
        with self._lock:
            self._closed = True
            client, self._client = self._client, None
        if client is not None:
            client.close()
