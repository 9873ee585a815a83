"""The kvstore connector: moves full KV blocks between the engine's paged cache and the store.

Data path (keys and block ids; usable without an engine):

- A block's value is ``kvstore.codec``'s encoding of ``kv_cache[:, :, block_id]`` in the
  canonical layout ``[num_layers, 2, block_size, num_kv_heads, head_dim]`` (C-contiguous,
  raw bytes of the cache dtype, bf16 included), filed under the block's ``BlockKey``.
- ``lookup(keys)`` is side-effect free: how many leading ``keys`` the store holds. A store
  that cannot be reached holds nothing (0); it never fails a request.
- ``load_blocks(keys, block_ids)`` fetches the blocks in one batch and verifies every one
  (header key, dtype, shape, checksum) before it reaches the cache: each block is verified
  where it lies (pinned in the store's arena on shared memory, in a reused receive buffer
  over TCP) and copied straight into its slot of a contiguous CPU cache, or into a pooled
  pinned ring whose verified rows go to a CUDA cache in groups of asynchronous copies
  (``kvstore.client.scatter``; reused by a later load once its copies are done). Without the
  native kernel the blocks land in a pooled buffer and are decoded and copied in Python. It returns the length of the leading run of verified blocks; a missing or
  corrupt block and everything after it are left for the engine to recompute (their slots
  may hold verified bytes of later blocks, which the recompute overwrites), and are counted.
  Unverified bytes never reach the cache.
- ``save_blocks(keys, block_ids, request_id)`` copies the blocks out of the cache at once (the
  engine may reuse them as soon as it returns) and hands the copy to a background thread that
  skips blocks the store already holds, encodes the rest and puts them in batches, overlapped
  with the next step's compute. ``flush(request_id)`` returns a future resolving to that
  request's ``SaveResult`` once every save queued for it so far is acknowledged or has failed.

Handoff (``engine.kv.handoff`` is the spec): a request marked with ``require_save(rid,
handoff=True)`` (phase "prefill") has its blocks put to this host's store node, not their
owners, and ``flush`` names that node (``SaveResult.node``); a request given
``set_source(rid, node)`` (a decode after such a prefill) looks its blocks up and loads them
from that node first, the rest from the owners.

Engine side: the methods of ``engine.core.connector_api.EngineConnector`` (``get_num_external_hits``,
``load``, ``save``, ``request_finished``) map a ``Request`` onto the data path and keep a
per-request tally (``take_load_result``) for the request's final stats. Which requests save
is a policy: ``save_all`` (every request, e.g. a prefill or colocated worker) or only the ones
marked with ``require_save`` (a request in phase "prefill" on any worker).

Threads: ``lookup``/``load*``/``save*``/``flush`` run on the engine thread; only the saver
thread uses ``save_client`` (pass a separate one when the client is not thread-safe).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import asdict, astuple, dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

from engine.kv.handoff import Placer, directory_of, source_client
from engine.kv.saver import SaveJob, SaveResult, Saver
from engine.kv.scatter import cache_slots, direct
from engine.kv.staging import StagingPool
from kvstore import codec
from kvstore.client.api import StoreClient
from kvstore.client.scatter import ScatterLoad, ring_slots, scatter_kernel
from kvstore.errors import CorruptBlock, KVStoreError
from kvstore.keys import BlockKey
from kvstore.native.blocks import VERIFY_CODES

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
    handoff_blocks: int = 0        # put to this host's node for a decode elsewhere to read
    source_hit_blocks: int = 0     # loaded from a handoff's source node
    placed_blocks: int = 0         # handed-off blocks copied on to their owners (background)
    place_dropped_blocks: int = 0  # ... not copied (queue full, gone from the local node)

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
        load_threads: int | None = None,
        load_path: Literal["auto", "direct", "staged", "python"] = "auto",
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
        # Threads a load's verify-and-copy may use (default: torch's, at most 4).
        self.load_threads = load_threads or min(4, torch.get_num_threads())
        self.save_all = save_all
        self.load_enabled = load_enabled
        self.stats = ConnectorStats()
        self._must_save: set[str] = set()
        self._handoff: set[str] = set()              # requests whose blocks stay on this host
        self._sources: dict[str, str] = {}           # request -> node its blocks were handed to
        self._load_dir, self._save_dir = directory_of(client), directory_of(self.save_client)
        self._placer = (Placer(self.save_client, self._save_dir)
                        if self._save_dir is not None else None)
        self._loads: dict[str, LoadResult] = {}
        self._stats_lock = threading.Lock()
        self._pool = StagingPool(self.block_shape, self.dtype, pin=kv_cache.is_cuda)
        # Loads run one at a time on the engine thread: one buffer per size is enough.
        self._load_pool = StagingPool((self.encoded_bytes,), torch.uint8, pin=kv_cache.is_cuda,
                                       keep_per_size=1)
        # A contiguous CPU cache loads through sinks that verify and scatter in one pass
        # (kvstore.client.scatter); CUDA caches and machines without the kernel take the staged path.
        self._scatter = scatter_kernel()
        self._direct = direct(kv_cache) if load_path == "auto" else load_path == "direct"
        if load_path == "python":
            self._scatter = None
        self._template = codec.header_template(self.dtype_name, self.block_shape)
        self._saver = Saver(self.save_client, self._save_dir, self._placer, self._pool, self.stats,
                            self._stats_lock, dtype_name=self.dtype_name,
                            block_shape=self.block_shape, payload_bytes=self.payload_bytes,
                            encoded_bytes=self.encoded_bytes, max_batch_blocks=self.max_batch_blocks)
        self._closed = False

    # --- the engine's EngineConnector protocol (engine thread) --------------------------------

    def get_num_external_hits(self, req: Request, num_device_hit_tokens: int) -> int:
        """Tokens after the device hits whose blocks the store holds (whole blocks)."""
        if not self.load_enabled:
            return 0
        start = num_device_hit_tokens // self.block_size
        return self.lookup(req.block_keys[start:], self._sources.get(req.request_id)) * self.block_size

    def load(self, req: Request, block_ids: Sequence[int]) -> int:
        """Load ``req``'s blocks from index ``num_computed_tokens // block_size`` on."""
        start = req.num_computed_tokens // self.block_size
        this = self.load_blocks(req.block_keys[start : start + len(block_ids)], block_ids,
                                self._sources.get(req.request_id))
        prev = self._loads.get(req.request_id)
        # Loaded again after a preemption: the request's tally sums both.
        self._loads[req.request_id] = (this if prev is None else LoadResult(
            *(a + b for a, b in zip(astuple(prev), astuple(this)))))
        return this.loaded

    def save(self, req: Request, block_ids: Sequence[int], keys: Sequence[BlockKey]) -> None:
        if self.save_all or req.request_id in self._must_save:
            node = (self._save_dir.local_node_id if self._save_dir is not None
                    and req.request_id in self._handoff else None)
            self.save_blocks(keys, block_ids, request_id=req.request_id, node=node)

    def request_finished(self, req: Request) -> None:
        self._forget_marks(req.request_id)

    def require_save(self, request_id: str, handoff: bool = False) -> None:
        """Save this request's blocks even when ``save_all`` is off (a phase="prefill" request);
        ``handoff``: to this host's node, for the decode worker to read (module docstring)."""
        self._must_save.add(request_id)
        if handoff:
            self._handoff.add(request_id)

    def set_source(self, request_id: str, node: str) -> None:
        """Look up and load this request's blocks from ``node`` first (a handoff's source)."""
        self._sources[request_id] = node

    def take_load_result(self, request_id: str) -> LoadResult:
        """The request's summed loads, forgotten afterwards (call once it has finished)."""
        self._forget_marks(request_id)
        return self._loads.pop(request_id, None) or LoadResult(0, 0)

    def _forget_marks(self, request_id: str) -> None:
        self._must_save.discard(request_id)
        self._handoff.discard(request_id)
        self._sources.pop(request_id, None)

    # --- lookup and load (engine thread) -----------------------------------------------------

    def lookup(self, keys: Sequence[BlockKey], source: str | None = None) -> int:
        """How many leading ``keys`` the store holds (0 when it cannot be reached); with
        ``source``, that node's leading run continued by the owners'."""
        if not keys:
            return 0
        try:
            n = 0
            if (src := source_client(self._load_dir, source)) is not None:
                with contextlib.suppress(KVStoreError):
                    n = int(src.prefix_len(list(keys)))
            if n < len(keys):
                n += int(self.client.prefix_len(list(keys[n:])))
        except KVStoreError as exc:
            log.warning("store lookup failed, treating as a miss: %s", exc)
            with self._stats_lock:
                self.stats.store_errors += 1
            return 0
        with self._stats_lock:
            self.stats.lookups += 1
            self.stats.lookup_hit_blocks += n
        return n

    def load_blocks(self, keys: Sequence[BlockKey], block_ids: Sequence[int],
                    source: str | None = None) -> LoadResult:
        """Fetch ``keys`` into cache blocks ``block_ids`` (from node ``source`` first, if
        given); return the verified leading run."""
        if len(keys) != len(block_ids):
            raise ValueError(f"{len(keys)} keys for {len(block_ids)} blocks")
        n = len(keys)
        if n == 0:
            return LoadResult(0, 0)
        t0 = time.perf_counter()
        buf = self._load_pool.take(n)  # pinned on CUDA; rows past n are unused
        # An exception leaves the buffer to the garbage collector (torch's pinned allocator
        # waits for any copy still reading it); a normal return gives it back.
        if self._scatter is not None:
            good, missing, corrupt, ready = self._fetch_scatter(buf, keys, block_ids, source)
        else:
            good, missing, corrupt, ready = self._fetch_verify_copy(buf, keys, block_ids, source)
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

    def _get(self, keys: list[BlockKey], dests: list[Any], source: str | None) -> list[bool]:
        """``client.get``, but from node ``source`` first and only its misses from the owners."""
        src = source_client(self._load_dir, source)
        if src is None:
            return self.client.get(keys, dests)
        try:
            found = src.get(keys, dests)
        except KVStoreError:
            found = [False] * len(keys)
        with self._stats_lock:
            self.stats.source_hit_blocks += sum(found)
        miss = [i for i, f in enumerate(found) if not f]
        if miss:
            for i, f in zip(miss, self.client.get([keys[i] for i in miss], [dests[i] for i in miss])):
                found[i] = f
        return found

    def _fetch_scatter(
        self, buf: torch.Tensor, keys: Sequence[BlockKey], block_ids: Sequence[int],
        source: str | None,
    ) -> tuple[int, int, int, torch.cuda.Event | None]:
        """Get ``keys`` through sinks that verify each block where it lies and copy it into its
        slot (``kvstore.client.scatter``); ``buf``'s rows are the TCP path's landing space."""
        assert self._scatter is not None
        n = len(keys)
        rows: torch.Tensor | None = None
        copy_rows: Callable[[int, int], None] | None = None
        if not self._direct:  # a pinned ring of payload rows, sent on in groups
            ring = rows = self._pool.take(n)
            ids = torch.tensor(list(block_ids), dtype=torch.long).to(self.kv_cache.device)

            def send(a: int, b: int) -> None:
                payload = ring[a:b].to(self.kv_cache.device, non_blocking=True)
                self.kv_cache.index_copy_(2, ids[a:b], payload.permute(1, 2, 0, 3, 4, 5))

            copy_rows = send

        if rows is None:
            slots, offsets, chunk = cache_slots(self.kv_cache, block_ids)
        else:
            slots, offsets, chunk = ring_slots(rows.data_ptr(), rows[0].nbytes, n)
        load = ScatterLoad(self._scatter, self._template, keys, slots, offsets, chunk,
                           buf.numpy(), threads=self.load_threads, copy_rows=copy_rows)
        try:
            found = self._get(list(keys), list(load.sinks), source)
        except KVStoreError as exc:
            log.warning("store load of %d blocks failed, recomputing them: %s", n, exc)
            with self._stats_lock:
                self.stats.store_errors += 1
            found, failed = [False] * n, True
        else:
            failed = False
        good, bad = load.leading_run(found)
        ready = None
        if rows is not None:
            load.finish(good)
            if self.kv_cache.is_cuda:  # the ring is reused once its last copy is done
                ready = torch.cuda.Event()
                ready.record(torch.cuda.current_stream(self.kv_cache.device))
            self._pool.give(rows, ready)
        if failed:
            return 0, n, 0, ready
        if bad < 0:
            return good, 0, 0, ready
        if not found[bad]:
            return good, 1, 0, ready
        log.warning("block %s failed verification (%s), recomputing it", keys[bad].hex(),
                    VERIFY_CODES.get(load.status[bad], load.status[bad]))
        return good, 0, 1, ready

    def _fetch_verify_copy(
        self, buf: torch.Tensor, keys: Sequence[BlockKey], block_ids: Sequence[int],
        source: str | None = None,
    ) -> tuple[int, int, int, torch.cuda.Event | None]:
        """Get ``keys`` into ``buf``'s rows, verify, copy the verified leading run into the
        cache. Returns (loaded, missing, corrupt, the CUDA event after the copy or None)."""
        n = len(keys)
        rows = buf.numpy()
        try:
            found = self._get(list(keys), [rows[i] for i in range(n)], source)
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
                    request_id: str | None = None, node: str | None = None) -> None:
        """Queue cache blocks ``block_ids`` for the store under ``keys`` (to node ``node``, a
        handoff, when given and reachable; else to their owners).

        The blocks are copied before this returns; encoding and the put happen on the saver
        thread. Failures are counted (and reported by ``flush``), never raised here.
        """
        if len(keys) != len(block_ids):
            raise ValueError(f"{len(keys)} keys for {len(block_ids)} blocks")
        if not keys:
            return
        if self._closed:
            raise RuntimeError("KVStoreConnector is closed")
        n = len(keys)
        buf = self._pool.take(n)
        staged = buf[:n]
        if self.kv_cache.is_cuda:  # gather on the device, then one copy to the host
            ids = torch.tensor(list(block_ids), dtype=torch.long, device=self.kv_cache.device)
            staged.copy_(self.kv_cache.index_select(2, ids).permute(2, 0, 1, 3, 4, 5))
        else:  # strided per-block copies straight into the staging rows (no temporary)
            for i, b in enumerate(block_ids):
                staged[i].copy_(self.kv_cache[:, :, b])
        self._saver.put(SaveJob(request_id, list(keys), staged, buffer=buf, node=node))

    def flush(self, request_id: str | None = None) -> Future[SaveResult]:
        """A future resolving to ``request_id``'s ``SaveResult`` once its queued saves are done.

        The saver is FIFO, so the marker resolves after every save queued before it. The
        request's tally is handed over and forgotten.
        """
        return self._saver.flush(request_id)

    def forget(self, request_id: str | None) -> None:
        """Drop the tally of a request nobody will flush (an abort)."""
        self.flush(request_id)

    def close(self, timeout: float = 10.0) -> None:
        """Finish queued saves (up to ``timeout``) and stop the saver thread."""
        if self._closed:
            return
        self._closed = True
        self._saver.close(timeout)
        if self._placer is not None:
            self._placer.close(timeout)

    def staging_allocations(self) -> int:
        """Host staging buffers allocated so far (pinned on CUDA). Loads and saves reuse pooled
        buffers, so this stops growing once each request size's power of two has been seen."""
        return self._pool.allocations + self._load_pool.allocations

    @property
    def placer_idle(self) -> bool:
        """No handed-off block waits for its copy to the owners (``engine.kv.handoff``)."""
        return self._placer is None or self._placer.idle

    def stats_snapshot(self) -> ConnectorStats:
        with self._stats_lock:
            out = ConnectorStats(**asdict(self.stats))
        if self._placer is not None:
            placed = self._placer.snapshot()
            out.placed_blocks, out.place_dropped_blocks = placed.placed_blocks, placed.dropped_blocks
        return out
