"""The worker's ordered event stream: device-cache block events and load reports.

Contract (the router's view is in docs/architecture.md, "Worker HTTP API"):

- Every event gets the next sequence number (1, 2, ...), one sequence shared by ``stored``,
  ``removed`` and ``load`` events. ``since(seq)`` returns the retained events after ``seq``
  in order; the ring keeps the last ``capacity`` events, so a reader that fell further behind
  sees a gap (its first event is not ``seq + 1``) and resynchronizes from ``snapshot()``.
- ``snapshot()`` is consistent with the sequence: its ``blocks`` are exactly the device cache
  after applying every event up to and including its ``seq``; the events that follow it
  start at ``seq + 1``.
- Publishing is thread-safe and never blocks on readers (the engine thread publishes;
  HTTP handlers on the event loop read). Readers wait with ``wait`` (threads) or
  ``wait_async`` (asyncio), woken on publish.

``RateMeter`` turns (tokens, seconds) samples into the EWMA rates of a load report.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Iterable
from typing import Literal

from engine.api.events import BlockEvent, LoadEvent, LoadFigures, Snapshot, WorkerEvent
from engine.core.block_manager import KVEvent
from kvstore.keys import BlockKey

__all__ = ["EventStream", "RateMeter"]


class RateMeter:
    """Exponentially weighted tokens/s over measured samples; 0.0 until the first sample.

    Each sample is weighted by ``alpha``; samples too short to mean anything (no tokens or no
    time) are ignored.
    """

    def __init__(self, alpha: float = 0.2) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.alpha = alpha
        self.rate = 0.0

    def update(self, tokens: int, seconds: float) -> float:
        if tokens <= 0 or seconds <= 0.0:
            return self.rate
        sample = tokens / seconds
        self.rate = sample if self.rate == 0.0 else self.rate + self.alpha * (sample - self.rate)
        return self.rate


class EventStream:
    """Numbered events in a bounded ring, the device-cache key set, and the latest load."""

    def __init__(self, capacity: int = 65536) -> None:
        if capacity <= 0:
            raise ValueError(f"event capacity must be positive, got {capacity}")
        self.capacity = capacity
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._ring: deque[WorkerEvent] = deque(maxlen=capacity)
        self._seq = 0
        self._blocks: dict[BlockKey, None] = {}  # insertion-ordered set
        self._load = LoadFigures()
        self._async_waiters: set[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = set()

    @property
    def seq(self) -> int:
        """The last sequence number handed out (0 before any event)."""
        with self._lock:
            return self._seq

    # --- publishing (any thread) --------------------------------------------------------------

    def publish_blocks(self, kind: Literal["stored", "removed"], keys: Iterable[BlockKey]) -> int:
        """Record blocks entering or leaving the device cache; return the event's seq."""
        if kind not in ("stored", "removed"):
            raise ValueError(f"block event type must be 'stored' or 'removed', got {kind!r}")
        keys = tuple(keys)
        with self._lock:
            if kind == "stored":
                for k in keys:
                    self._blocks[k] = None
            else:
                for k in keys:
                    self._blocks.pop(k, None)
            self._seq += 1
            self._ring.append(BlockEvent(self._seq, kind, keys))
            seq = self._seq
        self._wake()
        return seq

    def publish_load(self, load: LoadFigures) -> int:
        with self._lock:
            self._load = load
            self._seq += 1
            self._ring.append(LoadEvent(self._seq, load))
            seq = self._seq
        self._wake()
        return seq

    def on_kv_event(self, event: KVEvent) -> None:
        """The block manager's callback: ``event.type`` and ``event.keys``."""
        self.publish_blocks(event.type, event.keys)

    # --- reading ------------------------------------------------------------------------------

    def since(self, seq: int, limit: int | None = None) -> list[WorkerEvent]:
        """Retained events with sequence number > ``seq``, oldest first (at most ``limit``)."""
        with self._lock:
            if seq >= self._seq:
                return []
            first = self._seq - len(self._ring) + 1  # seq of self._ring[0]
            start = max(0, seq + 1 - first)
            stop = len(self._ring) if limit is None else min(len(self._ring), start + limit)
            return [self._ring[i] for i in range(start, stop)]

    def snapshot(self) -> Snapshot:
        with self._lock:
            return Snapshot(self._seq, tuple(self._blocks), self._load)

    @property
    def load(self) -> LoadFigures:
        with self._lock:
            return self._load

    def wait(self, after_seq: int, timeout: float | None = None) -> bool:
        """Block until an event after ``after_seq`` exists (True) or ``timeout`` passes."""
        with self._cond:
            return self._cond.wait_for(lambda: self._seq > after_seq, timeout)

    async def wait_async(self, after_seq: int, timeout: float | None = None) -> bool:
        """``wait`` for asyncio readers; never blocks the event loop."""
        waiter = (asyncio.get_running_loop(), asyncio.Event())
        with self._lock:
            if self._seq > after_seq:
                return True
            self._async_waiters.add(waiter)
        try:
            await asyncio.wait_for(waiter[1].wait(), timeout)
            return True
        except TimeoutError:
            with self._lock:
                return self._seq > after_seq
        finally:
            with self._lock:
                self._async_waiters.discard(waiter)

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()
            waiters = list(self._async_waiters)
        for loop, event in waiters:
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # that reader's loop is closed
                pass
