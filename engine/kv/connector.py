"""The kvstore connector: moves full KV blocks between the engine's paged cache and the store.

Data path (keys and block ids; usable without an engine):

- A block's value is ``kvstore.codec``'s encoding of ``kv_cache[:, :, block_id]`` in the
  canonical layout ``[num_layers, 2, block_size, num_kv_heads, head_dim]`` (C-contiguous,
  raw bytes of the cache dtype, bf16 included), filed under the block's ``BlockKey``.
- ``lookup(keys)`` is side-effect free: how many leading ``keys`` the store holds. A store
  that cannot be reached holds nothing (0); it never fails a request.
- ``load_blocks(keys, block_ids)`` fetches the blocks in one batch into a pooled staging
  buffer (pinned on CUDA, reused by a later load once its copy is done), verifies every one
  (header key, dtype, shape, checksum) and writes only the leading run of verified blocks into
  the cache. It returns that run's length; a missing or corrupt block and everything after it
  are left for the engine to recompute, and are counted. Unverified bytes never reach the cache.
- ``save_blocks(keys, block_ids, request_id)`` copies the blocks out of the cache at once (the
  engine may reuse them as soon as it returns) and hands the copy to a background thread that
  skips blocks the store already holds, encodes the rest and puts them in batches, overlapped
  with the next step's compute. ``flush(request_id)`` returns a future resolving to that
  request's ``SaveResult`` once every save queued for it so far is acknowledged or has failed.

Engine side: the methods of ``engine.core.connector_api.EngineConnector`` (``get_num_external_hits``,
``load``, ``save``, ``request_finished``) map a ``Request`` onto the data path and keep a
per-request tally (``take_load_result``) for the request's final stats. Which requests save
is a policy: ``save_all`` (every request, e.g. a prefill or colocated worker) or only the ones
marked with ``require_save`` (a request in phase "prefill" on any worker).

Threads: ``lookup``/``load*``/``save*``/``flush`` run on the engine thread; only the saver
thread uses ``save_client`` (pass a separate one when the client is not thread-safe).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import asdict, astuple, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from engine.kv.staging import StagingPool
from kvstore import codec
from kvstore.client.api import StoreClient
from kvstore.errors import CorruptBlock, KVStoreError
from kvstore.keys import BlockKey

if TYPE_CHECKING:
    from engine.core.request import Request

__all__ = ["ConnectorStats", "LoadResult", "SaveResult", "KVStoreConnector", "torch_dtype_name"]

log = logging.getLogger(__name__)

_MAX_BATCH_BYTES = 64 << 20  # a put batch stays under this many encoded bytes


def torch_dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``, the codec's dtype spelling."""
    name = str(dtype).removeprefix("torch.")
    if name not in codec.DTYPES:
        raise ValueError(f"KV cache dtype {dtype} has no block codec; one of {sorted(codec.DTYPES)}")
    return name


@dataclass(slots=True)
class ConnectorStats:
    """Cumulative counters (blocks, bytes, seconds) since the connector started."""

    lookups: int = 0
    lookup_hit_blocks: int = 0
    loaded_blocks: int = 0
    loaded_bytes: int = 0
    load_s: float = 0.0
    missing_blocks: int = 0        # the store said it had them, then did not
    corrupt_blocks: int = 0        # failed verification: recomputed instead
    saved_blocks: int = 0
    saved_bytes: int = 0
    save_s: float = 0.0
    save_failed_blocks: int = 0
    store_errors: int = 0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class LoadResult:
    """One ``load``: ``loaded`` leading blocks landed in the cache, verified."""

    loaded: int
    requested: int
    missing: int = 0
    corrupt: int = 0
    bytes: int = 0
    seconds: float = 0.0


@dataclass(slots=True)
class SaveResult:
    """The saves of one request so far: acknowledged blocks, failures, bytes, busy seconds."""

    saved_blocks: int = 0
    failed_blocks: int = 0
    bytes: int = 0
    seconds: float = 0.0


@dataclass(slots=True)
class _SaveJob:
    """Blocks to put under ``keys``: ``staged`` is their ``[n, *block_shape]`` host copy, a
    view of the pooled staging ``buffer`` (given back once the put is done)."""

    request_id: str | None
    keys: list[BlockKey]
    staged: torch.Tensor
    buffer: torch.Tensor


@dataclass(slots=True)
class _Flush:
    """Resolve ``done`` with the request's tally once every save queued before it is done."""

    request_id: str | None
    done: Future[SaveResult]


class _Idle:
    """Nothing queued (ends a batch inside the saver loop)."""


_IDLE = _Idle()


class KVStoreConnector:
    """Loads store hits into, and saves new full blocks from, one paged KV cache tensor.

    ``kv_cache`` is ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``.
    """

    def __init__(
        self,
        client: StoreClient,
        kv_cache: torch.Tensor,
        *,
        save_client: StoreClient | None = None,
        save_all: bool = True,
        load_enabled: bool = True,
        max_batch_bytes: int = _MAX_BATCH_BYTES,
    ) -> None:
        if kv_cache.dim() != 6 or kv_cache.shape[1] != 2:
            raise ValueError(
                "kv_cache must be [num_layers, 2, num_blocks, block_size, kv_heads, head_dim], "
                f"got {tuple(kv_cache.shape)}"
            )
        self.client = client
        self.save_client = save_client if save_client is not None else client
        self.kv_cache = kv_cache
        self.block_shape: tuple[int, ...] = (
            kv_cache.shape[0], 2, *kv_cache.shape[3:]
        )
        self.block_size = int(kv_cache.shape[3])
        self.dtype = kv_cache.dtype
        self.dtype_name = torch_dtype_name(kv_cache.dtype)
        self.payload_bytes = codec.encoded_size(self.dtype_name, self.block_shape) - codec.HEADER_SIZE
        self.encoded_bytes = codec.HEADER_SIZE + self.payload_bytes
        self.max_batch_blocks = max(1, max_batch_bytes // self.encoded_bytes)
        self.save_all = save_all
        self.load_enabled = load_enabled
        self.stats = ConnectorStats()
        self._must_save: set[str] = set()
        self._loads: dict[str, LoadResult] = {}
        self._stats_lock = threading.Lock()
        self._per_request: dict[str | None, SaveResult] = {}
        self._queue: queue.SimpleQueue[_SaveJob | _Flush | None] = queue.SimpleQueue()  # None: stop
        self._pool = StagingPool(self.block_shape, self.dtype, pin=kv_cache.is_cuda)
        # Loads run one at a time on the engine thread: one buffer per size is enough.
        self._load_pool = StagingPool((self.encoded_bytes,), torch.uint8, pin=kv_cache.is_cuda,
                                       keep_per_size=1)
        self._saver: threading.Thread | None = None
        self._closed = False

    # --- the engine's EngineConnector protocol (engine thread) --------------------------------

    def get_num_external_hits(self, req: Request, num_device_hit_tokens: int) -> int:
        """Tokens after the device hits whose blocks the store holds (whole blocks)."""
        if not self.load_enabled:
            return 0
        start = num_device_hit_tokens // self.block_size
        return self.lookup(req.block_keys[start:]) * self.block_size

    def load(self, req: Request, block_ids: Sequence[int]) -> int:
        """Load ``req``'s blocks from index ``num_computed_tokens // block_size`` on."""
        start = req.num_computed_tokens // self.block_size
        this = self.load_blocks(req.block_keys[start : start + len(block_ids)], block_ids)
        prev = self._loads.get(req.request_id)
        # Loaded again after a preemption: the request's tally sums both.
        self._loads[req.request_id] = (this if prev is None else LoadResult(
            *(a + b for a, b in zip(astuple(prev), astuple(this)))))
        return this.loaded

    def save(self, req: Request, block_ids: Sequence[int], keys: Sequence[BlockKey]) -> None:
        if self.save_all or req.request_id in self._must_save:
            self.save_blocks(keys, block_ids, request_id=req.request_id)

    def request_finished(self, req: Request) -> None:
        self._must_save.discard(req.request_id)

    def require_save(self, request_id: str) -> None:
        """Save this request's blocks even when ``save_all`` is off (a phase="prefill" request)."""
        self._must_save.add(request_id)

    def take_load_result(self, request_id: str) -> LoadResult:
        """The request's summed loads, forgotten afterwards (call once it has finished)."""
        self._must_save.discard(request_id)
        return self._loads.pop(request_id, None) or LoadResult(0, 0)

    # --- lookup and load (engine thread) -----------------------------------------------------

    def lookup(self, keys: Sequence[BlockKey]) -> int:
        """How many leading ``keys`` the store holds (0 when it cannot be reached)."""
        if not keys:
            return 0
        try:
            n = int(self.client.prefix_len(list(keys)))
        except KVStoreError as exc:
            log.warning("store lookup failed, treating as a miss: %s", exc)
            with self._stats_lock:
                self.stats.store_errors += 1
            return 0
        with self._stats_lock:
            self.stats.lookups += 1
            self.stats.lookup_hit_blocks += n
        return n

    def load_blocks(self, keys: Sequence[BlockKey], block_ids: Sequence[int]) -> LoadResult:
        """Fetch ``keys`` into cache blocks ``block_ids``; return the verified leading run."""
        if len(keys) != len(block_ids):
            raise ValueError(f"{len(keys)} keys for {len(block_ids)} blocks")
        n = len(keys)
        if n == 0:
            return LoadResult(0, 0)
        t0 = time.perf_counter()
        buf = self._load_pool.take(n)  # pinned on CUDA; rows past n are unused
        # An exception leaves the buffer to the garbage collector (torch's pinned allocator
        # waits for any copy still reading it); a normal return gives it back.
        good, missing, corrupt, ready = self._fetch_verify_copy(buf, keys, block_ids)
        self._load_pool.give(buf, ready)
        seconds = time.perf_counter() - t0
        nbytes = good * self.payload_bytes
        with self._stats_lock:
            self.stats.loaded_blocks += good
            self.stats.loaded_bytes += nbytes
            self.stats.load_s += seconds
            self.stats.missing_blocks += missing
            self.stats.corrupt_blocks += corrupt
        return LoadResult(good, n, missing=missing, corrupt=corrupt, bytes=nbytes, seconds=seconds)

    def _fetch_verify_copy(
        self, buf: torch.Tensor, keys: Sequence[BlockKey], block_ids: Sequence[int]
    ) -> tuple[int, int, int, torch.cuda.Event | None]:
        """Get ``keys`` into ``buf``'s rows, verify, copy the verified leading run into the
        cache. Returns (loaded, missing, corrupt, the CUDA event after the copy or None)."""
        n = len(keys)
        rows = buf.numpy()
        try:
            found = self.client.get(list(keys), [rows[i] for i in range(n)])
        except KVStoreError as exc:
            log.warning("store load of %d blocks failed, recomputing them: %s", n, exc)
            with self._stats_lock:
                self.stats.store_errors += 1
            return 0, n, 0, None
        good, missing, corrupt = 0, 0, 0
        for i in range(n):
            if not found[i]:
                missing = 1
                break
            try:
                header, _ = codec.decode(rows[i], expected_key=keys[i])
            except CorruptBlock as exc:
                log.warning("block %s failed verification, recomputing it: %s", keys[i].hex(), exc)
                corrupt = 1
                break
            if header.dtype != self.dtype_name or header.shape != self.block_shape:
                log.warning("block %s is %s%s, this cache holds %s%s; recomputing it",
                            keys[i].hex(), header.dtype, list(header.shape),
                            self.dtype_name, list(self.block_shape))
                corrupt = 1
                break
            good += 1
        if not good:
            return good, missing, corrupt, None
        payload = buf[:good, codec.HEADER_SIZE:].view(self.dtype).view(good, *self.block_shape)
        ids = torch.tensor(list(block_ids[:good]), dtype=torch.long)
        ready: torch.cuda.Event | None = None
        if self.kv_cache.is_cuda:
            # An asynchronous copy out of the pinned buffer: the event tells the pool when
            # the buffer may be written again.
            payload = payload.to(self.kv_cache.device, non_blocking=True)
            ids = ids.to(self.kv_cache.device)
        # One scatter: cache[:, :, ids] = payload as [L, 2, n, bs, H, D].
        self.kv_cache.index_copy_(2, ids, payload.permute(1, 2, 0, 3, 4, 5))
        if self.kv_cache.is_cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.kv_cache.device))
        return good, missing, corrupt, ready

    # --- save (engine thread enqueues, saver thread puts) ------------------------------------

    def save_blocks(self, keys: Sequence[BlockKey], block_ids: Sequence[int],
                    request_id: str | None = None) -> None:
        """Queue cache blocks ``block_ids`` for the store under ``keys``.

        The blocks are copied before this returns; encoding and the put happen on the saver
        thread. Failures are counted (and reported by ``flush``), never raised here.
        """
        if len(keys) != len(block_ids):
            raise ValueError(f"{len(keys)} keys for {len(block_ids)} blocks")
        if not keys:
            return
        if self._closed:
            raise RuntimeError("KVStoreConnector is closed")
        self._ensure_saver()
        n = len(keys)
        buf = self._pool.take(n)
        staged = buf[:n]
        if self.kv_cache.is_cuda:  # gather on the device, then one copy to the host
            ids = torch.tensor(list(block_ids), dtype=torch.long, device=self.kv_cache.device)
            staged.copy_(self.kv_cache.index_select(2, ids).permute(2, 0, 1, 3, 4, 5))
        else:  # strided per-block copies straight into the staging rows (no temporary)
            for i, b in enumerate(block_ids):
                staged[i].copy_(self.kv_cache[:, :, b])
        self._queue.put(_SaveJob(request_id, list(keys), staged, buffer=buf))

    def flush(self, request_id: str | None = None) -> Future[SaveResult]:
        """A future resolving to ``request_id``'s ``SaveResult`` once its queued saves are done.

        The saver is FIFO, so the marker resolves after every save queued before it. The
        request's tally is handed over and forgotten.
        """
        fut: Future[SaveResult] = Future()
        if self._saver is None:
            with self._stats_lock:
                fut.set_result(self._per_request.pop(request_id, SaveResult()))
            return fut
        self._queue.put(_Flush(request_id, fut))
        return fut

    def forget(self, request_id: str | None) -> None:
        """Drop the tally of a request nobody will flush (an abort)."""
        self.flush(request_id)

    def close(self, timeout: float = 10.0) -> None:
        """Finish queued saves (up to ``timeout``) and stop the saver thread."""
        if self._closed:
            return
        self._closed = True
        if self._saver is not None:
            self._queue.put(None)
            self._saver.join(timeout)

    def stats_snapshot(self) -> ConnectorStats:
        with self._stats_lock:
            return ConnectorStats(**asdict(self.stats))

    def _ensure_saver(self) -> None:
        if self._saver is None:
            self._saver = threading.Thread(target=self._save_loop, name="kv-saver", daemon=True)
            self._saver.start()

    def _save_loop(self) -> None:
        out = np.empty((self.max_batch_blocks, self.encoded_bytes), dtype=np.uint8)
        while True:
            item: _SaveJob | _Flush | _Idle | None = self._queue.get()
            batch: list[_SaveJob] = []
            n = 0
            # Coalesce queued saves into one put, up to the batch limit; a flush marker or
            # the stop sentinel ends the batch (and is handled after it).
            while isinstance(item, _SaveJob):
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
                self._put_batch(batch, out)
                for job in batch:
                    self._pool.give(job.buffer)
            if item is None:
                return
            if isinstance(item, _Flush):
                with self._stats_lock:
                    result = self._per_request.pop(item.request_id, SaveResult())
                item.done.set_result(result)

    def _put_batch(self, batch: list[_SaveJob], out: np.ndarray) -> None:
        # A single job may exceed the batch limit: split it into chunks.
        chunks: list[tuple[_SaveJob, int, int]] = []
        for job in batch:
            for lo in range(0, len(job.keys), self.max_batch_blocks):
                chunks.append((job, lo, min(len(job.keys), lo + self.max_batch_blocks)))
        i = 0
        while i < len(chunks):
            group: list[tuple[_SaveJob, int, int]] = []
            n = 0
            while i < len(chunks) and n + chunks[i][2] - chunks[i][1] <= self.max_batch_blocks:
                group.append(chunks[i])
                n += chunks[i][2] - chunks[i][1]
                i += 1
            self._put_group(group, out)

    def _put_group(self, group: list[tuple[_SaveJob, int, int]], out: np.ndarray) -> None:
        t0 = time.perf_counter()
        all_keys = [k for job, lo, hi in group for k in job.keys[lo:hi]]
        ok = True
        keys: list[BlockKey] = []
        sent: list[int] = []  # blocks shipped per group entry
        try:
            # Device-hit blocks are offered again in case the store lost them: send only those
            # it lacks (one round trip instead of encoding and shipping the bytes).
            present = self.save_client.contains(all_keys)
            values: list[np.ndarray] = []
            pos = 0
            for job, lo, hi in group:
                sent.append(0)
                raw = job.staged[lo:hi].view(torch.uint8).reshape(hi - lo, self.payload_bytes).numpy()
                for j in range(hi - lo):
                    if not present[pos]:
                        row = out[len(keys)]
                        codec.encode_into(row, job.keys[lo + j], self.dtype_name,
                                          self.block_shape, raw[j])
                        keys.append(job.keys[lo + j])
                        values.append(row)
                        sent[-1] += 1
                    pos += 1
            if keys:
                self.save_client.put(keys, values)
        except KVStoreError as exc:
            ok = False
            log.warning("store save of %d blocks failed; they will be recomputed on a miss: %s",
                        len(all_keys), exc)
        seconds = time.perf_counter() - t0
        n = len(all_keys)
        with self._stats_lock:
            if ok:
                self.stats.saved_blocks += n
                self.stats.saved_bytes += len(keys) * self.payload_bytes
            else:
                self.stats.save_failed_blocks += n
                self.stats.store_errors += 1
            self.stats.save_s += seconds
            for i, (job, lo, hi) in enumerate(group):
                tally = self._per_request.setdefault(job.request_id, SaveResult())
                if ok:
                    tally.saved_blocks += hi - lo
                    tally.bytes += sent[i] * self.payload_bytes
                else:
                    tally.failed_blocks += hi - lo
                tally.seconds += seconds * (hi - lo) / n
