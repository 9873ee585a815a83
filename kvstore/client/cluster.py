"""``ClusterClient``: the ``Client`` API over every store node registered in etcd.

Membership: the nodes are the live keys under ``/{cluster}/stores/`` (``kvstore.coord.layout``;
each value carries the node's ``address``, and ``"draining": true`` while it drains), mirrored
by a watched ``Membership``; placement is computed locally by rendezvous hashing
(``kvstore.client.placement``) over them. R, the replica count, is the cluster's setting in
etcd (``/{cluster}/config/store``, ``kvstore.coord.settings``), also watched, so every client
uses the same R (``replicas``; 1 when none is set). Nothing per block touches etcd.

Routing, per batch call (keys are split by node, each node gets one batched call, the calls
to different nodes run concurrently, results come back in the caller's order):

- A key's *targets* are the first R nodes of its rendezvous ranking that are reachable and
  not draining. A node that fails a call (``StoreUnavailable``) is skipped for the rest of the
  call and for ``retry_after`` seconds, and its keys go to their next-ranked node: the node
  that owns them once membership drops the dead one (within the registration TTL).
- ``put`` writes each key to its targets. ``get``/``get_bytes``/``contains`` ask the nodes of
  the key's ranking in order until one has it, stopping after R non-draining nodes answered
  "miss" (a draining node is asked where it ranks, but does not count: it still serves what it
  holds). A dead node costs hits, never an error: ``StoreUnavailable`` only when no node
  answered at all (or none is registered). ``prefix_len`` is the leading run of the merged
  ``contains``.
- Read repair (``kvstore.client.read_repair``): when a ``get``/``get_bytes`` hit came after
  targets that answered "miss", the block is written back to those targets by a background
  thread (bounded queue; dropped and counted when full; ``read_repair=False`` turns it off).
  ``stats()["read_repair"]`` has the counts.
- ``delete`` removes each key from its targets and from every draining node, and returns the
  number of copies removed (= blocks removed while R is 1).
- ``put`` answers per key (``Client.put``): True when at least one target holds the key; a
  full node fails its own keys and no one else's.

For callers that talk to one node themselves (e.g. a prefill->decode handoff):
``node_client(node_id)`` is the pooled per-node ``Client`` of a registered node, and
``local_node_id`` the registered node on this process's host (same ``host_id`` as
``kvstore.net.local_host_id()``: its ``Client`` maps the arena and moves bytes
over shared memory).

Per-node ``Client``s are created on first use (their path per ``transport``: shared memory,
UCX or TCP by what the node advertises, ``kvstore.client.transport``) and closed when their
node leaves. If etcd
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

from kvstore import tls as tls_settings
from kvstore.client.node import Client
from kvstore.client.placement import Placement, View
from kvstore.client.read_repair import ReadRepair, RepairItem
from kvstore.client.transport import Transport, pick
from kvstore.coord import layout, settings
from kvstore.coord.etcd import EtcdClient, client_for
from kvstore.coord.membership import Membership, MembershipChange
from kvstore.errors import StoreUnavailable
from kvstore.net.host_id import local_host_id

__all__ = ["ClusterClient"]

T = TypeVar("T")
_MAX_FANOUT = 16


class ClusterClient:
    """Rendezvous-placed batch operations over a cluster of store nodes (module docstring).

    ``on_change``, if given, is called (on a watch thread, after the view is updated) whenever
    the nodes, their draining flags or R change; the store daemon's repair pass uses it.
    """

    def __init__(
        self,
        etcd: str | list[str] | EtcdClient,
        cluster: str = "kvstore",
        *,
        auth_token: str | None = None,
        timeout: float = 5.0,
        retry_after: float = 1.0,
        read_repair: bool = True,
        on_change: Callable[[], None] | None = None,
        transport: Transport = "auto",
    ) -> None:
        self.prefix = layout.stores_prefix(cluster)  # a malformed cluster name fails here
        self.cluster = cluster
        self._auth_token = auth_token
        self._timeout = timeout
        self._retry_after = retry_after
        self._on_change_cb = on_change
        self._transport: Transport = transport
        self._lock = threading.Lock()
        self._members: dict[str, dict[str, Any]] = {}
        self._addresses: dict[str, str] = {}
        self._replicas = settings.DEFAULT_REPLICAS
        self._view = View()
        self._clients: dict[str, Client] = {}
        self._down_until: dict[str, float] = {}
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._closed = False
        self._repair = ReadRepair(self._client) if read_repair else None
        self._etcd, self._owns_etcd = client_for(etcd)
        self._config = Membership(self._etcd, layout.config_prefix(cluster),
                                  on_change=self._on_config)
        self._membership = Membership(self._etcd, self.prefix, on_change=self._on_change)
        try:
            self._config.start()  # EtcdUnavailable is a StoreUnavailable
            self._membership.start()
        except BaseException:
            self._membership.close()
            self._config.close()
            if self._owns_etcd:
                self._etcd.close()
            raise

    # -- membership and settings ----------------------------------------------------------

    def _on_config(self, change: MembershipChange) -> None:
        replicas = settings.replicas_of(change.members.get(layout.STORE_CONFIG))
        with self._lock:
            changed = replicas != self._replicas
            self._replicas = replicas
            self._view = View(self._view.placement, self._view.draining, replicas)
        if changed:
            self._notify()

    def _on_change(self, change: MembershipChange) -> None:
        members = {n: v for n, v in change.members.items() if v.get("address")}
        addresses = {node: str(v["address"]) for node, v in members.items()}
        draining = frozenset(n for n, v in members.items() if v.get("draining"))
        with self._lock:
            stale = [
                n for n, c in self._clients.items() if addresses.get(n) != self._addresses.get(n)
            ]
            dropped = [self._clients.pop(n) for n in stale]
            self._members = members
            self._addresses = addresses
            self._view = View(Placement(addresses), draining, self._replicas)
        for client in dropped:
            client.close()
        self._notify()

    def _notify(self) -> None:
        if self._on_change_cb is not None:
            self._on_change_cb()

    @property
    def nodes(self) -> dict[str, str]:
        """``{node_id: address}`` of the live store nodes, as last seen in etcd."""
        with self._lock:
            return dict(self._addresses)

    @property
    def members(self) -> dict[str, dict[str, Any]]:
        """``{node_id: registration value}`` of the live store nodes (treat as read-only)."""
        with self._lock:
            return dict(self._members)

    @property
    def replicas(self) -> int:
        """R, the cluster's replica count (``kvstore config set replicas N``; 1 if unset)."""
        return self._replicas

    @property
    def draining(self) -> frozenset[str]:
        """The live nodes that are draining: read from, never written to."""
        return self._view.draining

    def view(self) -> View:
        """This moment's placement, draining nodes and R (``kvstore.client.placement.View``)."""
        return self._view

    @property
    def etcd(self) -> EtcdClient:
        """The etcd client this ClusterClient watches with (shared; do not close it)."""
        return self._etcd

    @property
    def etcd_healthy(self) -> bool:
        return self._membership.healthy and self._config.healthy

    def owners(self, key: bytes) -> list[str]:
        """The node ids ``key`` is placed on now: its targets, ignoring reachability."""
        return self._view.targets(key)

    def wait_for_nodes(self, n: int, timeout: float) -> bool:
        """Block until at least ``n`` store nodes are registered; False on timeout."""
        return self._membership.wait_for(lambda ms: len(ms) >= n, timeout)

    # -- per-node clients -----------------------------------------------------------------

    def node_client(self, node_id: str) -> Client | None:
        """The pooled ``Client`` of registered node ``node_id`` (None if it is not registered).

        Shared with this ClusterClient's own calls (thread-safe, one connection); do not close
        it. Raises ``StoreUnavailable`` when the node is registered but cannot be reached.
        """
        with self._lock:
            if node_id not in self._addresses:
                return None
        try:
            return self._client(node_id)
        except StoreUnavailable:
            if node_id not in self.nodes:
                return None  # it left meanwhile
            raise

    @property
    def local_node_id(self) -> str | None:
        """The registered store node on this process's host (its registration's ``host_id`` is
        ``local_host_id()``), whose ``Client`` uses shared memory; a non-draining one first,
        then the smallest id. None when no node runs on this host."""
        here = local_host_id()
        with self._lock:
            local = [n for n, v in self._members.items() if v.get("host_id") == here]
            draining = self._view.draining
        local.sort(key=lambda n: (n in draining, n))
        return local[0] if local else None

    def _client(self, node: str) -> Client:
        with self._lock:
            if self._closed:
                raise StoreUnavailable("this ClusterClient is closed; create a new one")
            client = self._clients.get(node)
            address = self._addresses.get(node)
            member = self._members.get(node)
        if client is not None:
            return client
        if address is None:
            raise StoreUnavailable(f"store node {node} left the cluster")
        client = Client(address, auth_token=self._auth_token, timeout=self._timeout,
                        transport=pick(member, self._transport, tls=tls_settings.current() is not None))
        with self._lock:
            if self._addresses.get(node) == address and node not in self._clients:
                self._clients[node] = client
                return client
            existing = self._clients.get(node)
        client.close()
        if existing is None:
            raise StoreUnavailable(f"store node {node} left the cluster")
        return existing

    def _snapshot(self) -> tuple[View, set[str]]:
        now = time.monotonic()
        with self._lock:
            view = self._view
            down = {n for n, t in self._down_until.items() if t > now}
        if not len(view.placement):
            raise StoreUnavailable(
                f"no store nodes are registered under {self.prefix} in etcd "
                f"({', '.join(self._etcd.endpoints)}); start one with "
                f"`kvstore serve --etcd {self._etcd.endpoints[0]} --cluster {self.cluster}`"
            )
        return view, down

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
            except StoreUnavailable as exc:
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

    def _ask(
        self, groups: dict[str, list[int]], call: Callable[[Client, list[int]], T], skip: set[str]
    ) -> tuple[dict[str, T], list[int]]:
        """One round of a read or a write: ``call`` on every node's group (``_fan_out``). A
        node that fails is added to ``skip`` and marked down, one that answers is marked up;
        returns the answers by node, and the key indices of the failed nodes (to ask others)."""
        answers: dict[str, T] = {}
        failed: list[int] = []
        for node, result in self._fan_out(groups, call).items():
            if isinstance(result, BaseException):
                skip.add(node)
                self._mark_down(node)
                failed += groups[node]
            else:
                self._mark_up(node)
                answers[node] = result
        return answers, failed

    def _none_answered(self, tried: set[str]) -> StoreUnavailable:
        return StoreUnavailable(
            f"no store node of cluster {self.cluster!r} answered "
            f"(tried {sorted(tried)}); check that the daemons are running"
        )

    # -- reads ----------------------------------------------------------------------------

    def _read(
        self, keys: Sequence[bytes], call: Callable[[Client, list[int]], list[T]],
        hit: Callable[[T], bool], miss: T, repair: Callable[[T], bytes | None] | None = None,
    ) -> list[T]:
        """Ask each key's ranking in order (module docstring); ``repair`` (reads that bring a
        block) turns a hit after missing targets into a read repair: it gives the bytes to
        write back, or None to fetch them from the node that had them."""
        out: list[T] = [miss] * len(keys)
        if not keys:
            return out
        view, skip = self._snapshot()
        rankings = [view.placement.ranking(k) for k in keys]
        asked: list[list[str]] = [[] for _ in keys]  # nodes that answered "miss", in order
        pending = list(range(len(keys)))
        answered = False
        repairs: list[RepairItem] = []
        while pending:
            groups: dict[str, list[int]] = defaultdict(list)
            for i in pending:
                node = next((n for n in rankings[i] if n not in skip and n not in asked[i]), None)
                if node is not None:
                    groups[node].append(i)
            if not groups:
                break
            answers, pending = self._ask(groups, call, skip)
            answered = answered or bool(answers)
            for node, result in answers.items():
                for i, value in zip(groups[node], result):
                    if hit(value):
                        out[i] = value
                        if repair is not None and asked[i]:
                            self._plan_repair(view, keys[i], node, asked[i], repair(value),
                                              repairs)
                    else:
                        asked[i].append(node)
                        if sum(n not in view.draining for n in asked[i]) < view.replicas:
                            pending.append(i)
        if not answered:
            raise self._none_answered(skip)
        if repairs and self._repair is not None:
            self._repair.offer(repairs)
        return out

    def _plan_repair(self, view: View, key: bytes, source: str, missed: list[str],
                     value: bytes | None, into: list[RepairItem]) -> None:
        targets = set(view.targets(key))
        lacking = tuple(n for n in missed if n in targets)
        if lacking and self._repair is not None:
            into.append(RepairItem(bytes(key), source, lacking, value))

    def get(self, keys: Sequence[bytes], buffers: Sequence[Any]) -> list[bool]:
        """Copy each present block into its buffer; return which keys were found."""
        if len(keys) != len(buffers):
            raise ValueError(f"{len(keys)} keys but {len(buffers)} buffers")
        return self._read(
            keys,
            lambda c, idxs: c.get([keys[i] for i in idxs], [buffers[i] for i in idxs]),
            bool, False, repair=lambda _: None,
        )

    def get_bytes(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """Each block as ``bytes`` (None when absent)."""
        return self._read(
            keys, lambda c, idxs: c.get_bytes([keys[i] for i in idxs]),
            lambda v: v is not None, None, repair=lambda v: v,
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

    def _write(self, keys: Sequence[bytes], call: Callable[[Client, list[int]], T],
               draining_too: bool = False) -> list[tuple[list[int], T]]:
        """Run ``call`` on each key's targets (and on draining nodes if ``draining_too``);
        returns each node's result beside the key indices it was called with."""
        if not keys:
            return []
        view, skip = self._snapshot()
        written: list[set[str]] = [set() for _ in keys]
        pending = list(range(len(keys)))
        results: list[tuple[list[int], T]] = []
        extra = sorted(view.draining) if draining_too else []
        while pending:
            groups: dict[str, list[int]] = defaultdict(list)
            for i in pending:
                exclude = skip | written[i]
                need = view.replicas - len(written[i] - view.draining)
                for node in view.targets(keys[i], exclude)[:max(0, need)]:
                    groups[node].append(i)
                for node in extra:
                    if node not in exclude:
                        groups[node].append(i)
            if not groups:
                break
            answers, pending = self._ask(groups, call, skip)
            for node, result in answers.items():
                results.append((groups[node], result))
                for i in groups[node]:
                    written[i].add(node)
            pending = sorted(set(pending))
        if not results:
            raise self._none_answered(skip)
        return results

    def put(self, keys: Sequence[bytes], values: Sequence[Any]) -> list[bool]:
        """Store ``values[i]`` under ``keys[i]`` on its targets; per key, whether at least
        one target holds it (``Client.put``)."""
        if len(keys) != len(values):
            raise ValueError(f"{len(keys)} keys but {len(values)} values")
        held = [False] * len(keys)
        for idxs, flags in self._write(
                keys, lambda c, idxs: c.put([keys[i] for i in idxs], [values[i] for i in idxs])):
            for i, ok in zip(idxs, flags):
                held[i] = held[i] or ok
        return held

    def delete(self, keys: Sequence[bytes]) -> int:
        """Delete blocks from their targets and from draining nodes; returns the copies removed."""
        return sum(n for _, n in self._write(keys, lambda c, idxs: c.delete([keys[i] for i in idxs]),
                                             draining_too=True))

    # -- admin ----------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """``{"cluster", "etcd_healthy", "replicas", "read_repair", "nodes": {id: {"address",
        "draining", "stats" | "error"}}}``."""
        nodes: dict[str, Any] = {}
        draining = self.draining
        for node, address in sorted(self.nodes.items()):
            entry: dict[str, Any] = {"address": address, "draining": node in draining}
            try:
                entry["stats"] = self._client(node).stats()
            except StoreUnavailable as exc:
                entry["error"] = str(exc)
            nodes[node] = entry
        return {"cluster": self.cluster, "etcd_healthy": self.etcd_healthy,
                "replicas": self.replicas,
                "read_repair": self._repair.counts() if self._repair is not None else None,
                "nodes": nodes}

    @property
    def read_repair(self) -> ReadRepair | None:
        """The read-repair writer (None when turned off): ``counts()``, ``wait_idle()``."""
        return self._repair

    def close(self) -> None:
        """Stop watching etcd and close every node connection. Idempotent."""
        if self._repair is not None:
            self._repair.close()
        with self._lock:
            self._closed = True
            clients, self._clients = list(self._clients.values()), {}
            pool, self._pool = self._pool, None
        self._membership.close()
        self._config.close()
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
