"""The one-hop prefill→decode handoff: where a prefill's blocks go, where a decode reads them.

Rendezvous placement (the cluster client's ``put``) files every block at its owners, usually
another host's node, and the decode worker reads it from there: two network hops a block
when neither worker shares a host with the owner. Mooncake keeps the prefill's copy where it
was made and moves it once. So do we:

- A ``phase="prefill"`` request's new blocks are put to the store node on the prefill
  worker's own host (``local_node_id`` of the cluster client: shared memory, no network).
  Its final line names that node (``GenerateFinal.kv_node``); the router passes it on
  (``GenerateRequest.kv_source``), and the decode worker looks the request's blocks up and
  reads them from that node first (one TCP transfer, none when it shares the host), whatever
  it lacks from the owners, and recomputes what neither has.
- Reuse across the cluster still follows rendezvous: :class:`Placer` copies every handed-off
  block to each of its R owners that lacks it (asked one by one: a cluster lookup would find
  the local copy and stop), in the background, off the request path, read back from the
  local node over shared memory. It starts on a batch ``delay_s`` (1 s) after the
  batch was queued, so that the decode's read of the blocks, which follows the prefill's
  final line within milliseconds, does not share the link and the CPU with the copy. Its
  queue is bounded: a batch that does not fit is dropped and counted (those blocks stay on
  the local node only; a later request that computes them again puts them at their owners).
- No node on this host (one ``--store`` daemon elsewhere, or none here), or a local put that
  fails: the blocks go to their owners as before and the final line names no node. A source
  node that left or cannot be reached is a miss there, never an error.

``NodeDirectory`` is what the store client must offer for this (``ClusterClient`` does); a
client that does not (a single ``Client``) gets rendezvous placement only.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from kvstore.client.api import StoreClient
from kvstore.errors import KVStoreError
from kvstore.keys import BlockKey

__all__ = ["NodeDirectory", "Placer", "PlacerStats", "directory_of", "source_client"]

log = logging.getLogger(__name__)


@runtime_checkable
class NodeDirectory(Protocol):
    """A store client that can name this host's node, a key's owners, and reach one node."""

    @property
    def local_node_id(self) -> str | None: ...

    def owners(self, key: bytes) -> list[str]: ...

    def node_client(self, node_id: str) -> StoreClient | None: ...


def directory_of(client: StoreClient) -> NodeDirectory | None:
    """``client`` as a :class:`NodeDirectory`, or None when it is one node's client."""
    return client if isinstance(client, NodeDirectory) else None


def source_client(directory: NodeDirectory | None, node_id: str | None) -> StoreClient | None:
    """The client of node ``node_id`` (a handoff's source), or None when there is none to ask:
    no directory, no node named, the node is not registered or cannot be reached."""
    if directory is None or node_id is None:
        return None
    try:
        return directory.node_client(node_id)
    except KVStoreError as exc:
        log.info("handoff source node %s cannot be reached (%s); reading from the owners",
                 node_id, exc)
        return None


@dataclass(slots=True)
class PlacerStats:
    """Cumulative: blocks copied to their owners, found there already, dropped (queue full or
    read back failed), and failed batches."""

    placed_blocks: int = 0
    present_blocks: int = 0
    dropped_blocks: int = 0
    failed_batches: int = 0


class Placer:
    """Copies handed-off blocks from ``node`` to their rendezvous owners on a thread of its own
    (module docstring). ``submit`` never blocks; ``close`` finishes what is queued."""

    def __init__(self, cluster: StoreClient, directory: NodeDirectory, *,
                 max_batches: int = 256, delay_s: float = 1.0) -> None:
        self.cluster, self.directory, self.delay_s = cluster, directory, delay_s
        self.stats = PlacerStats()
        self._lock = threading.Lock()
        self._queue: queue.Queue[tuple[float, str, list[BlockKey]] | None] = queue.Queue(max_batches)
        self._thread: threading.Thread | None = None

    def submit(self, node: str, keys: Sequence[BlockKey]) -> bool:
        """Queue ``keys`` (held by ``node``) for their owners; False when the queue is full."""
        if not keys:
            return True
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kv-placer", daemon=True)
            self._thread.start()
        try:
            self._queue.put_nowait((time.monotonic() + self.delay_s, node, list(keys)))
            return True
        except queue.Full:
            with self._lock:
                self.stats.dropped_blocks += len(keys)
            return False

    @property
    def idle(self) -> bool:
        """Nothing queued or being copied."""
        return self._queue.unfinished_tasks == 0

    def snapshot(self) -> PlacerStats:
        with self._lock:
            return PlacerStats(self.stats.placed_blocks, self.stats.present_blocks,
                               self.stats.dropped_blocks, self.stats.failed_batches)

    def close(self, timeout: float = 10.0) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout)
            self._thread = None

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            due, node, keys = item
            time.sleep(max(0.0, due - time.monotonic()))
            try:
                self._place(node, keys)
            except KVStoreError as exc:
                log.info("copying %d handed-off blocks to their owners failed: %s", len(keys), exc)
                with self._lock:
                    self.stats.failed_batches += 1
                    self.stats.dropped_blocks += len(keys)
            finally:
                self._queue.task_done()

    def _place(self, node: str, keys: list[BlockKey]) -> None:
        by_owner: dict[str, list[BlockKey]] = {}
        for k in keys:
            for owner in self.directory.owners(k):
                if owner != node:
                    by_owner.setdefault(owner, []).append(k)
        lacking: dict[str, list[BlockKey]] = {}
        asked = 0
        for owner, ks in by_owner.items():
            client = source_client(self.directory, owner)
            if client is None:
                continue                      # gone: the repair pass re-replicates
            asked += len(ks)
            lacking[owner] = [k for k, p in zip(ks, client.contains(ks)) if not p]
        wanted = list(dict.fromkeys(k for ks in lacking.values() for k in ks))
        values: dict[BlockKey, bytes] = {}
        if wanted and (src := self.directory.node_client(node)) is not None:
            values = {k: v for k, v in zip(wanted, src.get_bytes(wanted)) if v is not None}
        placed = dropped = 0
        for owner, ks in lacking.items():
            have = [k for k in ks if k in values]
            client = source_client(self.directory, owner)
            kept = 0
            if have and client is not None:
                kept = sum(client.put(have, [values[k] for k in have]))
            placed, dropped = placed + kept, dropped + len(ks) - kept
        with self._lock:
            self.stats.placed_blocks += placed
            self.stats.dropped_blocks += dropped
            self.stats.present_blocks += asked - placed - dropped
