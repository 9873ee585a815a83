"""The connector's saver: one thread that puts queued blocks to the store, in batches.

``KVStoreConnector.save_blocks`` copies blocks out of the cache once, straight into the
payload of pooled put rows (``[HEADER_SIZE + payload]`` bytes each), and queues them here
(:meth:`Saver.put`); this thread seals each row's header in place (``kvstore.codec.seal``:
key, checksum) and puts the rows in batches of at most ``max_batch_blocks``: the client
writes each row straight into its reserved slot. Only jobs marked ``recheck`` (device hits
offered again, which the store usually holds) cost a ``contains`` round trip first; a put of
a block the store holds is a no-op there. A job's destination is the
blocks' owners, or one node (a handoff, ``engine.kv.handoff``): jobs for one destination are
batched together; a handoff whose node cannot be reached or fails the put goes to the owners.
Handed-off blocks are then offered to the ``Placer`` for their owners, off the request path.

:meth:`Saver.flush` queues a marker that resolves, FIFO, once every save queued before it for
that request is acknowledged or has failed, with the request's :class:`SaveResult`. Failures
are counted in the saver's own ``SaverStats`` and in the tally, never raised.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import asdict, dataclass

import numpy as np
import torch

from engine.kv.handoff import NodeDirectory, Placer, source_client
from kvstore import codec
from kvstore.client.api import StoreClient
from kvstore.errors import KVStoreError, StoreFull
from kvstore.keys import BlockKey
from kvstore.transfer.staging import StagingPool

__all__ = ["SaveResult", "SaveJob", "SaverStats", "Saver"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class SaveResult:
    """The saves of one request so far: acknowledged blocks, failures, bytes, busy seconds,
    and ``node``: the store node its blocks were handed off to (None: at their owners)."""

    saved_blocks: int = 0
    failed_blocks: int = 0
    bytes: int = 0
    seconds: float = 0.0
    node: str | None = None


@dataclass(slots=True)
class SaverStats:
    """The saver's cumulative counters."""

    saved_blocks: int = 0
    saved_bytes: int = 0
    save_s: float = 0.0
    save_failed_blocks: int = 0
    store_errors: int = 0
    handoff_blocks: int = 0        # put to this host's node for a decode elsewhere to read


@dataclass(slots=True)
class SaveJob:
    """Blocks to put under ``keys``: ``rows`` are their encoded rows ``[n, HEADER_SIZE +
    payload]`` (payloads filled, headers not yet), the first rows of the pooled ``buffer``
    (given back once the put is done). ``recheck``: the store likely holds them already."""

    request_id: str | None
    keys: list[BlockKey]
    rows: np.ndarray
    buffer: torch.Tensor
    node: str | None = None        # put there (a handoff), not at the owners
    recheck: bool = False


@dataclass(slots=True)
class _Flush:
    """Resolve ``done`` with the request's tally once every save queued before it is done."""

    request_id: str | None
    done: Future[SaveResult]


class _Idle:
    """Nothing queued (ends a batch inside the saver loop)."""


_IDLE = _Idle()


class Saver:
    """The saver thread and its queue (module docstring); started on the first ``put``."""

    def __init__(self, client: StoreClient, directory: NodeDirectory | None, placer: Placer | None,
                 pool: StagingPool, *, dtype_name: str, block_shape: tuple[int, ...],
                 payload_bytes: int, encoded_bytes: int, max_batch_blocks: int) -> None:
        self.client, self.directory, self.placer, self.pool = client, directory, placer, pool
        self.stats, self.lock = SaverStats(), threading.Lock()
        self.dtype_name, self.block_shape = dtype_name, block_shape
        self.payload_bytes, self.encoded_bytes = payload_bytes, encoded_bytes
        self.max_batch_blocks = max_batch_blocks
        self._per_request: dict[str | None, SaveResult] = {}
        self._queue: queue.SimpleQueue[SaveJob | _Flush | None] = queue.SimpleQueue()  # None: stop
        self._thread: threading.Thread | None = None

    def put(self, job: SaveJob) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kv-saver", daemon=True)
            self._thread.start()
        self._queue.put(job)

    def flush(self, request_id: str | None) -> Future[SaveResult]:
        fut: Future[SaveResult] = Future()
        if self._thread is None:
            with self.lock:
                fut.set_result(self._per_request.pop(request_id, SaveResult()))
            return fut
        self._queue.put(_Flush(request_id, fut))
        return fut

    def close(self, timeout: float) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout)

    def snapshot(self) -> SaverStats:
        with self.lock:
            return SaverStats(**asdict(self.stats))

    def _run(self) -> None:
        while True:
            item: SaveJob | _Flush | _Idle | None = self._queue.get()
            batch: list[SaveJob] = []
            n = 0
            # Coalesce queued saves into one put, up to the batch limit; a flush marker or
            # the stop sentinel ends the batch (and is handled after it).
            while isinstance(item, SaveJob):
                batch.append(item)
                n += len(item.keys)
                if n >= self.max_batch_blocks:
                    item = _IDLE
                    break
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    item = _IDLE
            if batch:
                self._put_batch(batch)
                for job in batch:
                    self.pool.give(job.buffer)
            if item is None:
                return
            if isinstance(item, _Flush):
                with self.lock:
                    result = self._per_request.pop(item.request_id, SaveResult())
                item.done.set_result(result)

    def _put_batch(self, batch: list[SaveJob]) -> None:
        # Jobs for one destination (the owners, or a handoff's node) go together; a single
        # job may exceed the batch limit: split it into chunks.
        for node in dict.fromkeys(job.node for job in batch):
            chunks: list[tuple[SaveJob, int, int]] = []
            for job in (j for j in batch if j.node == node):
                for lo in range(0, len(job.keys), self.max_batch_blocks):
                    chunks.append((job, lo, min(len(job.keys), lo + self.max_batch_blocks)))
            i = 0
            while i < len(chunks):
                group: list[tuple[SaveJob, int, int]] = []
                n = 0
                while i < len(chunks) and n + chunks[i][2] - chunks[i][1] <= self.max_batch_blocks:
                    group.append(chunks[i])
                    n += chunks[i][2] - chunks[i][1]
                    i += 1
                if node is None or not self._put_group(group, node):
                    self._put_group(group, None)

    def _put_group(self, group: list[tuple[SaveJob, int, int]], node: str | None) -> bool:
        """Put one group to the owners (``node`` None) or to ``node``. A handoff that cannot
        reach its node, or fails there, returns False having counted nothing: the caller
        puts the group to the owners instead."""
        client = self.client
        if node is not None and (client := source_client(self.directory, node)) is None:
            return False
        t0 = time.perf_counter()
        all_keys = [k for job, lo, hi in group for k in job.keys[lo:hi]]
        ok = True
        keys: list[BlockKey] = []
        sent: list[int] = []  # blocks shipped per group entry
        try:
            # Device-hit blocks are offered again in case the store lost them: send only those
            # it lacks (one round trip instead of sealing and shipping the bytes).
            checked = [k for job, lo, hi in group if job.recheck for k in job.keys[lo:hi]]
            present = iter(client.contains(checked) if checked else ())
            values: list[np.ndarray] = []
            for job, lo, hi in group:
                sent.append(0)
                for j in range(lo, hi):
                    if job.recheck and next(present):
                        continue
                    row = job.rows[j]
                    codec.seal(row, job.keys[j], self.dtype_name, self.block_shape)
                    keys.append(job.keys[j])
                    values.append(row)
                    sent[-1] += 1
            if keys and not all(held := client.put(keys, values)):
                raise StoreFull(f"the store kept {sum(held)} of {len(keys)} blocks")
        except KVStoreError as exc:
            if node is not None:
                log.info("handoff put to node %s failed (%s); putting to the owners", node, exc)
                return False
            ok = False
            log.warning("store save of %d blocks failed; they will be recomputed on a miss: %s",
                        len(all_keys), exc)
        seconds = time.perf_counter() - t0
        n = len(all_keys)
        with self.lock:
            if ok:
                self.stats.saved_blocks += n
                self.stats.saved_bytes += len(keys) * self.payload_bytes
            else:
                self.stats.save_failed_blocks += n
                self.stats.store_errors += 1
            self.stats.save_s += seconds
            if node is not None:
                self.stats.handoff_blocks += n
            for i, (job, lo, hi) in enumerate(group):
                tally = self._per_request.setdefault(job.request_id, SaveResult())
                if ok:
                    tally.saved_blocks += hi - lo
                    tally.bytes += sent[i] * self.payload_bytes
                    tally.node = node if node is not None else tally.node
                else:
                    tally.failed_blocks += hi - lo
                tally.seconds += seconds * (hi - lo) / n
        if node is not None and self.placer is not None:
            self.placer.submit(node, keys)   # on to their owners, off the request path
        return ok
