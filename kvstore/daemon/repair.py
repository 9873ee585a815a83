"""Re-replication: each store daemon keeps R copies of what it holds after membership changes.

Runs inside every ``kvstore serve`` that has ``--etcd`` (``Repairer``), with its own
``ClusterClient`` (the same view of nodes, draining flags and R as every client's:
``kvstore.client.placement.View``). The rules:

- When: a pass starts ``--repair-settle`` seconds (0.5) after the last change of the cluster's
  nodes, their draining flags or R (a burst of changes is one pass; a change during a pass
  makes another), every ``--repair-interval`` seconds (600; 0: never) to catch what a failed
  write left behind, and on a drain (``kvstore.daemon.drain``). One pass at a time per daemon.
- What: every block this node holds, hottest first (``BlockStore.held_keys``: blocks being
  read, the host tier from its most recent end, then GPU, then SSD by recency), in chunks of
  256. For each block the key's *targets* are its first R non-draining live nodes.
- Who pushes: only the highest-ranked live holder. A node asks the nodes ranked above it in the
  key's ranking (draining ones too) whether they hold the block (``contains``, batched per
  node); if one does, that one pushes and this one does nothing. So after a node dies each
  lost copy is pushed once, by the best-ranked survivor, not by every holder. A node that
  does not answer counts as not holding (a duplicate push is a no-op put, never wrong).
- Where: the targets that answer that they lack the block (``contains``), by a batched ``put``
  to each; a target that cannot be reached is a failure of this pass (the next change or
  interval retries). A node never pushes to itself, and never deletes its own copy: a copy
  beyond R is cache, and eviction takes it in time.
- Draining (``drain=True``): the node is not a target of anything; it pushes every block
  whose targets lack it, whatever the ranking (it is leaving, so it is the holder that must).
- Rate: at most ``--repair-rate`` bytes/s (a token bucket; 64M). ``--repair-rate 0`` turns the
  background passes off; a drain then pushes unthrottled.
- Progress: Prometheus ``kvstore_repair_*`` (``kvstore.daemon.metrics``: blocks and bytes
  pushed, failures, passes, blocks pending in the running pass, the last pass's seconds).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from dataclasses import dataclass

from kvstore.client.cluster import ClusterClient
from kvstore.daemon.metrics import RepairMetrics
from kvstore.errors import KVStoreError
from kvstore.keys import BlockKey
from kvstore.node.store import BlockStore

__all__ = ["Repairer", "PassResult", "DEFAULT_RATE", "DEFAULT_INTERVAL", "DEFAULT_SETTLE"]

log = logging.getLogger(__name__)

DEFAULT_RATE = 64 << 20  # bytes/s
DEFAULT_INTERVAL = 600.0  # seconds
DEFAULT_SETTLE = 0.5  # seconds
_CHUNK = 256  # blocks checked per round of contains calls
_PUT_BYTES = 16 << 20  # bytes per put call (the rate limiter's granularity)


@dataclass
class PassResult:
    """What one pass did. ``no_target``: blocks with no node to go to (every other node gone
    or draining)."""

    checked: int = 0
    pushed: int = 0
    pushed_bytes: int = 0
    failed: int = 0
    no_target: int = 0
    seconds: float = 0.0


class _Bucket:
    """A token bucket of ``rate`` bytes/s (0: unlimited); ``take`` sleeps, ``stop`` wakes it."""

    def __init__(self, rate: float, stop: threading.Event) -> None:
        self.rate = rate
        self._stop = stop
        self._tokens = rate
        self._at = time.monotonic()

    def take(self, n: int) -> None:
        if self.rate <= 0:
            return
        now = time.monotonic()
        self._tokens = min(self.rate, self._tokens + (now - self._at) * self.rate)
        self._at = now
        self._tokens -= n
        if self._tokens < 0:
            self._stop.wait(-self._tokens / self.rate)


class Repairer:
    """The daemon's re-replication (module docstring). ``start()`` connects to etcd and starts
    the background thread; ``run_pass()`` may also be called directly (the drain does)."""

    def __init__(self, store: BlockStore, node_id: str, etcd: str, cluster: str, *,
                 auth_token: str | None = None, metrics: RepairMetrics | None = None,
                 rate: float = DEFAULT_RATE, interval: float = DEFAULT_INTERVAL,
                 settle: float = DEFAULT_SETTLE) -> None:
        self.store = store
        self.node_id = node_id
        self.metrics = metrics or RepairMetrics()
        self.rate, self.interval, self.settle = rate, interval, settle
        self._etcd, self._cluster_name, self._token = etcd, cluster, auth_token
        self._stop = threading.Event()
        self._changed = threading.Event()
        self._pass_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.cluster: ClusterClient | None = None
        self.last: PassResult | None = None

    def start(self) -> "Repairer":
        self.cluster = ClusterClient(self._etcd, self._cluster_name, auth_token=self._token,
                                     read_repair=False, on_change=self._changed.set)
        if self.rate > 0:
            self._thread = threading.Thread(target=self._run, name="kvstore-repair", daemon=True)
            self._thread.start()
        return self

    def trigger(self) -> None:
        """Ask for a pass (as a membership change does)."""
        self._changed.set()

    def close(self) -> None:
        self._stop.set()
        self._changed.set()
        if self._thread is not None:
            self._thread.join(timeout=10.0)
        if self.cluster is not None:
            self.cluster.close()

    # -- the thread -----------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            self._changed.wait(self.interval if self.interval > 0 else None)
            while self._changed.is_set() and not self._stop.is_set():  # settle a burst
                self._changed.clear()
                self._stop.wait(self.settle)
            if self._stop.is_set():
                return
            try:
                self.run_pass()
            except Exception:  # keep the thread; the next change retries
                log.exception("re-replication pass failed")

    # -- one pass -------------------------------------------------------------------------

    def run_pass(self, drain: bool = False) -> PassResult:
        """Check every held block once and push the copies that are missing (module docstring)."""
        with self._pass_lock:
            result = PassResult()
            t0 = time.monotonic()
            bucket = _Bucket(self.rate, self._stop)
            keys = self.store.held_keys()
            pending = len(keys)
            self.metrics.pending.set(pending)
            try:
                for start in range(0, len(keys), _CHUNK):
                    if self._stop.is_set():
                        break
                    chunk = keys[start:start + _CHUNK]
                    self._chunk(chunk, drain, bucket, result)
                    pending -= len(chunk)
                    self.metrics.pending.set(pending)
            finally:
                self.metrics.pending.set(0)
            result.seconds = time.monotonic() - t0
            self.metrics.passes.inc()
            self.metrics.last_pass.set(result.seconds)
            self.last = result
            if result.pushed or result.failed or result.no_target:
                log.info("re-replication pass: %d blocks checked, %d copies pushed (%d bytes), "
                         "%d failed, %d without a target, %.2f s", result.checked, result.pushed,
                         result.pushed_bytes, result.failed, result.no_target, result.seconds)
            return result

    def _chunk(self, keys: list[BlockKey], drain: bool, bucket: _Bucket, result: PassResult) -> None:
        assert self.cluster is not None, "start() first"
        view = self.cluster.view()
        if self.node_id not in view.placement.node_ids:
            return  # not registered (yet, or any more): no ranking to act on
        me = self.node_id
        plans: list[tuple[list[str], list[str]]] = []  # per key: (higher-ranked, wanted targets)
        ask: dict[str, list[int]] = defaultdict(list)
        for i, key in enumerate(keys):
            ranking = view.placement.ranking(key)
            higher = [] if drain else ranking[:ranking.index(me)]
            want = [t for t in view.targets(key) if t != me]
            if not want and me not in view.targets(key):
                result.no_target += 1
            plans.append((higher, want))
            for node in (higher + want) if want else ():
                ask[node].append(i)
        result.checked += len(keys)
        holds: dict[str, dict[int, bool]] = {}
        for node, idxs in ask.items():
            holds[node] = self._contains(node, [keys[i] for i in idxs], idxs)
        push: dict[str, list[int]] = defaultdict(list)
        for i, (higher, want) in enumerate(plans):
            if any(holds[h].get(i) for h in higher):
                continue  # a higher-ranked holder pushes it
            for t in want:
                answer = holds[t].get(i)
                if answer is None:  # the target did not answer
                    result.failed += 1
                    self.metrics.failures.inc()
                elif not answer:
                    push[t].append(i)
        values: dict[int, bytes | None] = {}
        for target, idxs in push.items():
            blocks: list[tuple[BlockKey, bytes]] = []
            for i in idxs:
                if i not in values:
                    values[i] = self.store.copy_out(keys[i])
                v = values[i]
                if v is not None:  # evicted or deleted since: nothing to keep
                    blocks.append((keys[i], v))
            self._push(target, blocks, bucket, result)

    def _contains(self, node: str, keys: list[BlockKey], idxs: list[int]) -> dict[int, bool]:
        """``{idx: holds}``; ``{}`` when the node cannot be asked."""
        assert self.cluster is not None
        try:
            client = self.cluster.node_client(node)
            if client is None:
                return {}
            return dict(zip(idxs, client.contains(keys)))
        except KVStoreError as exc:
            log.debug("re-replication: %s did not answer contains: %s", node, exc)
            return {}

    def _push(self, target: str, blocks: list[tuple[BlockKey, bytes]], bucket: _Bucket,
              result: PassResult) -> None:
        assert self.cluster is not None
        start = 0
        while start < len(blocks):
            end, size = start, 0
            while end < len(blocks) and (end == start or size + len(blocks[end][1]) <= _PUT_BYTES):
                size += len(blocks[end][1])
                end += 1
            part = blocks[start:end]
            start = end
            bucket.take(size)
            try:
                client = self.cluster.node_client(target)
                if client is None:
                    raise KVStoreError(f"{target} left the cluster")
                held = client.put([k for k, _ in part], [v for _, v in part])
                if not all(held):
                    raise KVStoreError(f"{target} is full: it kept {sum(held)} of {len(part)}")
            except KVStoreError as exc:
                log.warning("re-replication to %s failed for %d blocks: %s", target, len(part), exc)
                result.failed += len(part)
                self.metrics.failures.inc(len(part))
                continue
            result.pushed += len(part)
            result.pushed_bytes += size
            self.metrics.blocks.inc(len(part))
            self.metrics.bytes.inc(size)
