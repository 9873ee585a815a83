"""Read repair: write a block back to the owners a read found without it, off the read's path.

``ClusterClient.get`` / ``get_bytes`` read a key from its nodes in ranking order. When a
target (one of the key's first R non-draining nodes) answered "miss" and a later node had
the block, the read hands ``(key, source, targets, value)`` to ``ReadRepair.offer`` and
returns; one background thread then writes the block to those targets (a ``get_bytes`` hit
brings its bytes; a ``get`` into the caller's buffers does not, so the thread fetches the
block from the node that had it first: the caller's buffers are the caller's).

Bounded: at most ``max_pending`` keys wait; an offer past that is dropped and counted
(``dropped``), never blocks a read. Failures (a node down, full) are counted (``failed``)
and forgotten: the repair pass of the daemons (``kvstore.daemon.repair``) and later reads
get another chance. ``counts()`` gives ``{"queued", "written", "dropped", "failed",
"pending"}``; ``written`` counts copies (a key written to two targets is 2).
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass

from kvstore.client.node import Client
from kvstore.errors import KVStoreError

__all__ = ["ReadRepair", "RepairItem"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RepairItem:
    key: bytes
    source: str  # the node that had the block
    targets: tuple[str, ...]  # targets that answered "miss"
    value: bytes | None  # the block, when the read brought it


class ReadRepair:
    """One background writer of read repairs (module docstring). Thread-safe."""

    def __init__(self, client_for: Callable[[str], Client], max_pending: int = 4096) -> None:
        self._client_for = client_for
        self.max_pending = max_pending
        self._queue: deque[RepairItem] = deque()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._busy = 0
        self.queued = self.written = self.dropped = self.failed = 0

    def offer(self, items: list[RepairItem]) -> None:
        """Queue what fits; drop (and count) the rest. Never blocks on I/O."""
        if not items:
            return
        with self._cond:
            if self._closed:
                return
            room = max(0, self.max_pending - len(self._queue))
            self._queue.extend(items[:room])
            self.queued += min(room, len(items))
            self.dropped += len(items) - min(room, len(items))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvstore-read-repair",
                                                daemon=True)
                self._thread.start()
            self._cond.notify()

    def counts(self) -> dict[str, int]:
        with self._cond:
            return {"queued": self.queued, "written": self.written, "dropped": self.dropped,
                    "failed": self.failed, "pending": len(self._queue) + self._busy}

    def wait_idle(self, timeout: float) -> bool:
        """Block until nothing is queued or being written (tests, shutdown); False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._busy, timeout)

    def close(self) -> None:
        """Stop the thread; what is still queued is dropped (not counted). Idempotent."""
        with self._cond:
            self._closed = True
            self._queue.clear()
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5.0)

    # -- the thread -----------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closed)
                if self._closed:
                    return
                batch = [self._queue.popleft() for _ in range(min(256, len(self._queue)))]
                self._busy = len(batch)
            try:
                written, failed = self._write(batch)
            except Exception:  # never let a bug kill the thread silently
                log.exception("read repair of %d blocks failed", len(batch))
                written, failed = 0, sum(len(i.targets) for i in batch)
            with self._cond:
                self._busy = 0
                self.written += written
                self.failed += failed
                self._cond.notify_all()

    def _write(self, batch: list[RepairItem]) -> tuple[int, int]:
        values: dict[bytes, bytes | None] = {i.key: i.value for i in batch if i.value is not None}
        fetch: dict[str, list[bytes]] = defaultdict(list)
        for item in batch:
            if item.value is None and item.key not in values:
                fetch[item.source].append(item.key)
        failed = 0
        for source, keys in fetch.items():
            try:
                got = self._client_for(source).get_bytes(keys)
            except KVStoreError:
                got = [None] * len(keys)
            values.update(zip(keys, got))
        per_target: dict[str, dict[bytes, bytes]] = defaultdict(dict)
        for item in batch:
            value = values.get(item.key)
            for target in item.targets:
                if value is None:
                    failed += 1
                else:
                    per_target[target][item.key] = value
        written = 0
        for target, blocks in per_target.items():
            try:
                self._client_for(target).put(list(blocks), list(blocks.values()))
                written += len(blocks)
            except KVStoreError as exc:
                log.debug("read repair to %s failed: %s", target, exc)
                failed += len(blocks)
        return written, failed
