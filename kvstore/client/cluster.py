"""``ClusterClient``: the ``Client`` API over every store node registered in etcd.

Membership: the nodes are the live keys under ``/{cluster}/stores/`` (``kvstore.coord.layout``;
each value carries the node's ``address``), mirrored by a watched ``Membership``; placement is
computed locally by rendezvous hashing (``kvstore.client.placement``) over them. Nothing per
block touches etcd.

Routing, per batch call (keys are split by node, each node gets one batched call, the calls
to different nodes run concurrently, results come back in the caller's order):

- A key's *targets* are the first ``replicas`` nodes of its rendezvous ranking that are
  reachable. A node that fails a call (``StoreUnavailable``) is skipped for the rest of the
  call and for ``retry_after`` seconds, and its keys go to their next-ranked node: the node
  that owns them once membership drops the dead one (within the registration TTL).
- ``put`` writes each key to its targets. ``get``/``get_bytes``/``contains`` ask the first
  target and, on a miss, the next one, up to ``replicas`` nodes that answered. A dead node
  costs hits, never an error: ``StoreUnavailable`` only when no node answered at all (or
  none is registered). ``prefix_len`` is the leading run of the merged ``contains``.
- ``delete`` removes each key from its targets and returns the number of copies removed
  (= blocks removed while ``replicas`` is 1).
- ``StoreFull`` from one node is raised after every other node's share was written.

Per-node ``Client``s are created on first use and closed when their node leaves. If etcd
becomes unreachable the last known membership stays in use (``etcd_healthy`` says so).
Thread-safe: calls from several threads may run at once.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from kvstore.client.node import Client
from kvstore.errors import StoreFull, StoreUnavailable
from kvstore.coord import layout
from kvstore.coord.etcd import EtcdClient, client_for
from kvstore.coord.membership import Membership, MembershipChange
from kvstore.client.placement import Placement

__all__ = ["ClusterClient"]

T = TypeVar("T")
_MAX_FANOUT = 16


class ClusterClient:
    """Rendezvous-placed batch operations over a cluster of store nodes (module docstring)."""

    def __init__(
        self,
        etcd: str | list[str] | EtcdClient,
        cluster: str = "kvstore",
        *,
        auth_token: str | None = None,
        timeout: float = 5.0,
        replicas: int = 1,
        retry_after: float = 1.0,
    ) -> None:
        if replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {replicas}")
        self.prefix = layout.stores_prefix(cluster)  # a malformed cluster name fails here
        self.cluster = cluster
        self.replicas = replicas
        self._auth_token = auth_token
        self._timeout = timeout
        self._retry_after = retry_after
        self._lock = threading.Lock()
        self._addresses: dict[str, str] = {}
        self._placement = Placement(())
        self._clients: dict[str, Client] = {}
        self._down_until: dict[str, float] = {}
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._closed = False
        self._etcd, self._owns_etcd = client_for(etcd)
        self._membership = Membership(self._etcd, self.prefix, on_change=self._on_change)
        try:
            self._membership.start()  # EtcdUnavailable is a StoreUnavailable
        except BaseException:
            self._membership.close()
            if self._owns_etcd:
                self._etcd.close()
            raise

    # -- membership -----------------------------------------------------------------------

    def _on_change(self, change: MembershipChange) -> None:
        addresses = {
            node: str(v["address"]) for node, v in change.members.items() if v.get("address")
        }
        with self._lock:
            stale = [
                n for n, c in self._clients.items() if addresses.get(n) != self._addresses.get(n)
            ]
            dropped = [self._clients.pop(n) for n in stale]
            self._addresses = addresses
            self._placement = Placement(addresses)
        for client in dropped:
            client.close()

    @property
    def nodes(self) -> dict[str, str]:
        """``{node_id: address}`` of the live store nodes, as last seen in etcd."""
        with self._lock:
            return dict(self._addresses)

    @property
    def etcd_healthy(self) -> bool:
        return self._membership.healthy

    def owners(self, key: bytes) -> list[str]:
        """The node ids ``key`` is placed on now (ignoring reachability)."""
        with self._lock:
            placement = self._placement
        return placement.owners(key, self.replicas)

    def wait_for_nodes(self, n: int, timeout: float) -> bool:
        """Block until at least ``n`` store nodes are registered; False on timeout."""
        return self._membership.wait_for(lambda ms: len(ms) >= n, timeout)

    # -- per-node clients -----------------------------------------------------------------

    def _client(self, node: str) -> Client:
        with self._lock:
            if self._closed:
                raise StoreUnavailable("this ClusterClient is closed; create a new one")
            client = self._clients.get(node)
            address = self._addresses.get(node)
        if client is not None:
            return client
        if address is None:
            raise StoreUnavailable(f"store node {node} left the cluster")
        client = Client(address, auth_token=self._auth_token, timeout=self._timeout)
        with self._lock:
            if self._addresses.get(node) == address and node not in self._clients:
                self._clients[node] = client
                return client
            existing = self._clients.get(node)
        client.close()
        if existing is None:
            raise StoreUnavailable(f"store node {node} left the cluster")
        return existing

    def _snapshot(self) -> tuple[Placement, set[str]]:
        now = time.monotonic()
        with self._lock:
            placement = self._placement
            down = {n for n, t in self._down_until.items() if t > now}
        if not len(placement):
            raise StoreUnavailable(
                f"no store nodes are registered under {self.prefix} in etcd "
                f"({', '.join(self._etcd.endpoints)}); start one with "
                f"`kvstore serve --etcd {self._etcd.endpoints[0]} --cluster {self.cluster}`"
            )
        return placement, down

    def _mark_down(self, node: str) -> None:
        with self._lock:
            self._down_until[node] = time.monotonic() + self._retry_after

    def _mark_up(self, node: str) -> None:
        if node in self._down_until:
            with self._lock:
                self._down_until.pop(node, None)

    def _fan_out(
        self, groups: dict[str, list[int]], call: Callable[[Client, list[int]], T]
    ) -> dict[str, T | BaseException]:
        """Run ``call(client, idxs)`` for every node's group; exceptions are returned."""

        def one(node: str) -> T | BaseException:
            try:
                return call(self._client(node), groups[node])
            except (StoreUnavailable, StoreFull) as exc:
                return exc

        if len(groups) == 1:
            node = next(iter(groups))
            return {node: one(node)}
        with self._lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    _MAX_FANOUT, thread_name_prefix="kvstore-cluster"
                )
            pool = self._pool
        futures = {node: pool.submit(one, node) for node in groups}
        return {node: f.result() for node, f in futures.items()}

    @staticmethod
    def _target(placement: Placement, key: bytes, exclude: set[str]) -> str | None:
        """The first node of ``key``'s ranking not in ``exclude`` (None if there is none)."""
        first = placement.owners(key)[0]
        if first not in exclude:
            return first
        return next((n for n in placement.ranking(key) if n not in exclude), None)

    # -- reads ----------------------------------------------------------------------------

    def _read(
        self, keys: Sequence[bytes], call: Callable[[Client, list[int]], list[T]],
        hit: Callable[[T], bool], miss: T,
    ) -> list[T]:
        out: list[T] = [miss] * len(keys)
        if not keys:
            return out
        placement, skip = self._snapshot()
        asked: list[set[str]] = [set() for _ in keys]  # nodes that answered "miss"
        pending = list(range(len(keys)))
        answered = False
        while pending:
            groups: dict[str, list[int]] = defaultdict(list)
            for i in pending:
                node = self._target(placement, keys[i], skip | asked[i] if asked[i] else skip)
                if node is not None:
                    groups[node].append(i)
            if not groups:
                break
            pending = []
            for node, result in self._fan_out(groups, call).items():
                idxs = groups[node]
                if isinstance(result, BaseException):
                    skip.add(node)
                    self._mark_down(node)
                    pending += idxs
                    continue
                answered = True
                self._mark_up(node)
                for i, value in zip(idxs, result):
                    if hit(value):
                        out[i] = value
                    else:
                        asked[i].add(node)
                        if len(asked[i]) < self.replicas:
                            pending.append(i)
        if not answered:
            raise StoreUnavailable(
                f"no store node of cluster {self.cluster!r} answered "
                f"(tried {sorted(skip)}); check that the daemons are running"
            )
        return out

    def get(self, keys: Sequence[bytes], buffers: Sequence[Any]) -> list[bool]:
        """Copy each present block into its buffer; return which keys were found."""
        if len(keys) != len(buffers):
            raise ValueError(f"{len(keys)} keys but {len(buffers)} buffers")
        return self._read(
            keys,
            lambda c, idxs: c.get([keys[i] for i in idxs], [buffers[i] for i in idxs]),
            bool, False,
        )

    def get_bytes(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """Each block as ``bytes`` (None when absent)."""
        return self._read(
            keys, lambda c, idxs: c.get_bytes([keys[i] for i in idxs]),
            lambda v: v is not None, None,
        )

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        return self._read(keys, lambda c, idxs: c.contains([keys[i] for i in idxs]), bool, False)

    def prefix_len(self, keys: Sequence[bytes]) -> int:
        """How many leading keys are stored anywhere in the cluster."""
        n = 0
        for present in self.contains(keys):
            if not present:
                break
            n += 1
        return n

    # -- writes ---------------------------------------------------------------------------

    def _write(self, keys: Sequence[bytes], call: Callable[[Client, list[int]], T]) -> list[T]:
        """Run ``call`` on each key's targets; returns the per-node results."""
        if not keys:
            return []
        placement, skip = self._snapshot()
        written: list[set[str]] = [set() for _ in keys]
        pending = list(range(len(keys)))
        results: list[T] = []
        full: StoreFull | None = None
        while pending:
            groups: dict[str, list[int]] = defaultdict(list)
            for i in pending:
                exclude = skip | written[i]
                for _ in range(self.replicas - len(written[i])):
                    node = self._target(placement, keys[i], exclude)
                    if node is None:
                        break
                    groups[node].append(i)
                    exclude.add(node)
            if not groups:
                break
            pending = []
            for node, result in self._fan_out(groups, call).items():
                idxs = groups[node]
                if isinstance(result, StoreFull):
                    full = full or result
                elif isinstance(result, BaseException):
                    skip.add(node)
                    self._mark_down(node)
                    pending += idxs
                else:
                    self._mark_up(node)
                    results.append(result)
                    for i in idxs:
                        written[i].add(node)
            pending = sorted(set(pending))
        if not results and full is None:
            raise StoreUnavailable(
                f"no store node of cluster {self.cluster!r} answered "
                f"(tried {sorted(skip)}); check that the daemons are running"
            )
        if full is not None:
            raise full
        return results

    def put(self, keys: Sequence[bytes], values: Sequence[Any]) -> None:
        """Store ``values[i]`` under ``keys[i]`` on its owner(s)."""
        if len(keys) != len(values):
            raise ValueError(f"{len(keys)} keys but {len(values)} values")
        self._write(keys, lambda c, idxs: c.put([keys[i] for i in idxs], [values[i] for i in idxs]))

    def delete(self, keys: Sequence[bytes]) -> int:
        """Delete blocks from their owners; returns how many stored copies were removed."""
        return sum(self._write(keys, lambda c, idxs: c.delete([keys[i] for i in idxs])))

    # -- admin ----------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """``{"cluster", "etcd_healthy", "nodes": {id: {"address", "stats" | "error"}}}``."""
        nodes: dict[str, Any] = {}
        for node, address in sorted(self.nodes.items()):
            try:
                nodes[node] = {"address": address, "stats": self._client(node).stats()}
            except StoreUnavailable as exc:
                nodes[node] = {"address": address, "error": str(exc)}
        return {"cluster": self.cluster, "etcd_healthy": self.etcd_healthy, "nodes": nodes}

    def close(self) -> None:
        """Stop watching etcd and close every node connection. Idempotent."""
        with self._lock:
            self._closed = True
            clients, self._clients = list(self._clients.values()), {}
            pool, self._pool = self._pool, None
        self._membership.close()
        if pool is not None:
            pool.shutdown(wait=True)
        for client in clients:
            client.close()
        if self._owns_etcd:
            self._etcd.close()

    def __enter__(self) -> "ClusterClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"ClusterClient({self.cluster!r}, nodes={len(self.nodes)}, replicas={self.replicas})"
