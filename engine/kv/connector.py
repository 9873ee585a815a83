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
  native kernel the blocks land in a pooled buffer and are decoded and copied in Python. It
  returns the length of the leading run of verified blocks; a missing or corrupt block and
  everything after it are left for the engine to recompute (their slots may hold verified bytes
  of later blocks, which the recompute overwrites), and are counted. Unverified bytes never
  reach the cache.
- ``save_blocks(keys, block_ids, request_id)`` copies the blocks out of the cache at once (the
  engine may reuse them as soon as it returns) and hands the copy to a background thread that
  skips blocks the store already holds, encodes the rest and puts them in batches, overlapped
  with the next step's compute. ``flush(request_id)`` returns a future resolving to that
  request's ``SaveResult`` once every save queued for it so far is acknowledged or has failed.

Handoff (``engine.kv.handoff`` is the spec): a request whose ``Request.kv`` says ``save``
and ``handoff`` (phase "prefill") has its blocks put to this host's store node, not their
owners, and ``flush`` names that node (``SaveResult.node``); a request whose ``kv.source``
names a node (a decode after such a prefill) looks its blocks up and loads them from that node
first, the rest from the owners.

Engine side: ``engine.core.connector_api.EngineConnector``. Lookups (``lookup_ahead``,
``get_num_external_hits``) run on a lookup thread with ``lookup_client``, loads
(``start_load``) on a loader thread with ``client``: the engine thread only hands work over
and collects what ended (``finished_loads``), so a running batch never waits for a prompt's
KV. On CUDA the loader copies on a side stream; the engine's stream waits for its event when
the load is collected. Which requests save is a policy: ``save_all`` (every request, e.g. a
prefill or colocated worker) or only those whose ``kv.save`` is set. ``on_ready``, when set,
is called (on an I/O thread) each time a lookup or load ends: a worker loop asleep on its
inbox wakes up.

Threads: ``lookup``/``load_blocks`` (the synchronous data path) run on the caller's thread;
``save_blocks``/``flush`` on the engine thread; only the saver thread uses ``save_client``.
A ``Client`` serializes its calls, so give the three threads separate clients (the worker
does) or a lookup waits behind a load.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

from engine.core.connector_api import LoadDone
from engine.core.request import LoadTally
from engine.kv.handoff import Placer, directory_of, source_client
from engine.kv.saver import SaveJob, Saver, SaveResult
from engine.kv.scatter import PagedCache, direct
from kvstore import codec
from kvstore.client.api import StoreClient
from kvstore.errors import KVStoreError
from kvstore.keys import BlockKey
from kvstore.transfer.loader import BlockLoader
from kvstore.transfer.staging import StagingPool

if TYPE_CHECKING:
    from engine.core.request import Request

__all__ = ["ConnectorStats", "LoadTally", "SaveResult", "KVStoreConnector", "torch_dtype_name"]

log = logging.getLogger(__name__)

_MAX_BATCH_BYTES = 64 << 20  # a put batch stays under this many encoded bytes
_SAVE_GROUP = 16             # blocks a CPU save copies out before the saver may start on them


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
        lookup_client: StoreClient | None = None,
        save_all: bool = True,
        load_enabled: bool = True,
        max_batch_bytes: int = _MAX_BATCH_BYTES,
        load_threads: int | None = None,
        load_path: Literal["auto", "direct", "staged", "python"] = "auto",
        io: Literal["threads", "inline"] = "threads",
        lookup_wait_s: float = 0.003,
    ) -> None:
        """``io="inline"``: lookups and loads run on the engine thread as the scheduler asks
        (the step waits for them; kept to measure what the I/O threads save).
        ``lookup_wait_s``: how long after a lookup was sent the scheduler's question may wait
        for its answer (a local store answers within it, so the request is not put off a
        step; a slow one costs the step at most this)."""
        if kv_cache.dim() != 6 or kv_cache.shape[1] != 2:
            raise ValueError(
                "kv_cache must be [num_layers, 2, num_blocks, block_size, kv_heads, head_dim], "
                f"got {tuple(kv_cache.shape)}"
            )
        self.client = client
        self.save_client = save_client if save_client is not None else client
        self.lookup_client = lookup_client if lookup_client is not None else client
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
        self.on_ready: Callable[[], None] | None = None
        if io not in ("threads", "inline"):
            raise ValueError(f"io must be 'threads' or 'inline', got {io!r}")
        self.inline = io == "inline"
        self.lookup_wait_s = lookup_wait_s
        self._load_dir, self._save_dir = directory_of(client), directory_of(self.save_client)
        self._lookup_dir = directory_of(self.lookup_client)
        self._placer = (Placer(self.save_client, self._save_dir)
                        if self._save_dir is not None else None)
        self._stats_lock = threading.Lock()
        # The I/O threads (started on first use) and what they hand back, under _io_lock.
        self._io_lock = threading.Lock()
        self._lookups: queue.SimpleQueue[tuple[str, list[BlockKey], str | None, int] | None] = queue.SimpleQueue()
        self._loads: queue.SimpleQueue[tuple[str, list[BlockKey], list[int], str | None] | None] = queue.SimpleQueue()
        self._io_threads: list[threading.Thread] = []
        self._answered = threading.Condition(self._io_lock)
        self._asked: dict[str, tuple[int, float]] = {}  # request -> (first block, sent at) pending
        self._answers: dict[str, tuple[int, int]] = {}  # request -> (first block, blocks held)
        self._done: list[tuple[LoadDone, torch.cuda.Event | None]] = []
        self._ready = threading.Event()
        self._side_stream = torch.cuda.Stream(kv_cache.device) if kv_cache.is_cuda else None
        # Put rows (header + payload) for saves.
        self._pool = StagingPool((self.encoded_bytes,), torch.uint8, pin=kv_cache.is_cuda)
        # Loads (kvstore.transfer.loader): a contiguous CPU cache is written in place
        # by the verifying sinks; a CUDA cache through a pinned ring; no kernel, in Python.
        path = load_path if load_path != "auto" else ("direct" if direct(kv_cache) else "staged")
        self._loader = BlockLoader(PagedCache(kv_cache, self.block_shape, self.payload_bytes),
                                   self.dtype_name, self.block_shape, path=path,
                                   threads=self.load_threads)
        self._saver = Saver(self.save_client, self._save_dir, self._placer, self._pool,
                            dtype_name=self.dtype_name,
                            block_shape=self.block_shape, payload_bytes=self.payload_bytes,
                            encoded_bytes=self.encoded_bytes, max_batch_blocks=self.max_batch_blocks)
        self._closed = False

    # --- the engine's EngineConnector protocol (engine thread) --------------------------------

    def lookup_ahead(self, req: Request) -> None:
        if self.load_enabled and not self.inline:
            self._ask(req.request_id, req.block_keys, req.kv.source, 0)

    def get_num_external_hits(self, req: Request, num_device_hit_tokens: int) -> int | None:
        """Tokens after the device hits whose blocks the store holds (whole blocks); None
        while the lookup thread has not answered. An answer is used once."""
        if not self.load_enabled:
            return 0
        rid, start = req.request_id, num_device_hit_tokens // self.block_size
        for attempt in range(2):
            with self._answered:
                pending = self._asked.get(rid)
                if pending is not None and pending[0] <= start and rid not in self._answers:
                    # Sent a moment ago: a local store answers within lookup_wait_s.
                    left = pending[1] + self.lookup_wait_s - time.monotonic()
                    if left > 0:
                        self._answered.wait_for(lambda: rid in self._answers, left)
                answer = self._answers.pop(rid, None)
                pending = self._asked.get(rid)
            if answer is not None and answer[0] <= start:
                first, held = answer
                return max(0, first + held - start) * self.block_size
            if attempt or (pending is not None and pending[0] <= start):
                return None
            self._ask(rid, req.block_keys[start:], req.kv.source, start)
        return None

    def _ask(self, rid: str, keys: Sequence[BlockKey], source: str | None, first: int) -> None:
        if self.inline:
            held = self.lookup(keys, source, client=self.lookup_client, directory=self._lookup_dir)
            with self._io_lock:
                self._answers[rid] = (first, held)
            return
        self._start_io()
        with self._io_lock:
            self._asked[rid] = (first, time.monotonic())
        self._lookups.put((rid, list(keys), source, first))

    def start_load(self, req: Request, block_ids: Sequence[int]) -> None:
        start = req.num_computed_tokens // self.block_size
        job = (req.request_id, list(req.block_keys[start : start + len(block_ids)]),
               list(block_ids), req.kv.source)
        if self.inline:
            tally = self.load_blocks(job[1], job[2], job[3])
            with self._io_lock:
                self._done.append((LoadDone(req.request_id, tally), None))
            return
        self._start_io()
        self._loads.put(job)

    def finished_loads(self) -> list[LoadDone]:
        with self._io_lock:
            done, self._done = self._done, []
            self._ready.clear()
        if self._side_stream is not None:
            stream = torch.cuda.current_stream(self.kv_cache.device)
            for _, event in done:
                if event is not None:  # the engine's next kernels read what the loader copied
                    stream.wait_event(event)
        return [d for d, _ in done]

    def wait(self, timeout: float) -> None:
        self._ready.wait(timeout)

    def save(self, req: Request, block_ids: Sequence[int], keys: Sequence[BlockKey],
             held: bool = False) -> None:
        if self.save_all or req.kv.save:
            node = (self._save_dir.local_node_id if self._save_dir is not None
                    and req.kv.handoff else None)
            self.save_blocks(keys, block_ids, request_id=req.request_id, node=node, recheck=held)

    def request_finished(self, req: Request) -> None:
        with self._io_lock:
            self._asked.pop(req.request_id, None)
            self._answers.pop(req.request_id, None)

    # --- the I/O threads -----------------------------------------------------------------------

    def _start_io(self) -> None:
        if self._io_threads or self._closed:
            return
        self._io_threads = [threading.Thread(target=self._lookup_loop, name="kv-lookup", daemon=True),
                            threading.Thread(target=self._load_loop, name="kv-loader", daemon=True)]
        for t in self._io_threads:
            t.start()

    def _lookup_loop(self) -> None:
        while (job := self._lookups.get()) is not None:
            rid, keys, source, first = job
            held = self.lookup(keys, source, client=self.lookup_client, directory=self._lookup_dir)
            with self._answered:
                pending = self._asked.get(rid)
                if pending is None or pending[0] != first:
                    continue  # finished meanwhile, or asked again from another block
                del self._asked[rid]
                self._answers[rid] = (first, held)
                self._ready.set()
                self._answered.notify_all()
            self._notify()

    def _load_loop(self) -> None:
        while (job := self._loads.get()) is not None:
            rid, keys, block_ids, source = job
            event = None
            try:
                if self._side_stream is not None:
                    with torch.cuda.stream(self._side_stream):
                        tally = self.load_blocks(keys, block_ids, source)
                        event = torch.cuda.Event()
                        event.record(self._side_stream)
                else:
                    tally = self.load_blocks(keys, block_ids, source)
            except Exception:  # never let one load stop the thread: its blocks are recomputed
                log.exception("store load of %d blocks failed, recomputing them", len(keys))
                tally = LoadTally(0, len(keys))
            with self._io_lock:
                self._done.append((LoadDone(rid, tally), event))
                self._ready.set()
            self._notify()

    def _notify(self) -> None:
        callback = self.on_ready
        if callback is not None:
            try:
                callback()
            except Exception:
                log.exception("the connector's on_ready callback failed")

    # --- lookup and load (the caller's thread: the I/O threads, or a script) -------------------

    def lookup(self, keys: Sequence[BlockKey], source: str | None = None, *,
               client: StoreClient | None = None, directory: Any = None) -> int:
        """How many leading ``keys`` the store holds (0 when it cannot be reached); with
        ``source``, that node's leading run continued by the owners'."""
        if not keys:
            return 0
        client = client if client is not None else self.client
        directory = directory if directory is not None else self._load_dir
        try:
            n = 0
            if (src := source_client(directory, source)) is not None:
                with contextlib.suppress(KVStoreError):
                    n = int(src.prefix_len(list(keys)))
            if n < len(keys):
                n += int(client.prefix_len(list(keys[n:])))
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
                    source: str | None = None) -> LoadTally:
        """Fetch ``keys`` into cache blocks ``block_ids`` (from node ``source`` first, if
        given); return the verified leading run."""
        if len(keys) != len(block_ids):
            raise ValueError(f"{len(keys)} keys for {len(block_ids)} blocks")
        n = len(keys)
        if n == 0:
            return LoadTally(0, 0)
        t0 = time.perf_counter()
        try:
            good, missing, corrupt = self._loader.load(
                lambda ks, dests: self._get(ks, dests, source), keys, block_ids)
        except KVStoreError as exc:
            log.warning("store load of %d blocks failed, recomputing them: %s", n, exc)
            with self._stats_lock:
                self.stats.store_errors += 1
            good, missing, corrupt = 0, n, 0
        seconds = time.perf_counter() - t0
        nbytes = good * self.payload_bytes
        with self._stats_lock:
            self.stats.loaded_blocks += good
            self.stats.loaded_bytes += nbytes
            self.stats.load_s += seconds
            self.stats.missing_blocks += missing
            self.stats.corrupt_blocks += corrupt
        return LoadTally(good, n, missing=missing, corrupt=corrupt, bytes=nbytes, seconds=seconds)

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

    # --- save (engine thread enqueues, saver thread puts) ------------------------------------

    def save_blocks(self, keys: Sequence[BlockKey], block_ids: Sequence[int],
                    request_id: str | None = None, node: str | None = None,
                    recheck: bool = False) -> None:
        """Queue cache blocks ``block_ids`` for the store under ``keys`` (to node ``node``, a
        handoff, when given and reachable; else to their owners). ``recheck``: the store
        likely holds them (device hits): put only those it lacks.

        The blocks are copied once, into the payloads of put rows, before this returns; the
        headers and the put happen on the saver thread. Failures are counted (and reported by
        ``flush``), never raised here.
        """
        if len(keys) != len(block_ids):
            raise ValueError(f"{len(keys)} keys for {len(block_ids)} blocks")
        if not keys:
            return
        if self._closed:
            raise RuntimeError("KVStoreConnector is closed")
        # On CPU the copy goes out in groups, each queued as it is done: the saver seals and
        # puts one group while this thread copies the next. On CUDA one gather and one copy.
        group = len(keys) if self.kv_cache.is_cuda else _SAVE_GROUP
        for lo in range(0, len(keys), group):
            ids, n = list(block_ids[lo:lo + group]), len(block_ids[lo:lo + group])
            buf = self._pool.take(n)
            payload = buf[:n, codec.HEADER_SIZE:].view(self.dtype).view(n, *self.block_shape)
            if self.kv_cache.is_cuda:  # gather on the device, then one copy to the host
                index = torch.tensor(ids, dtype=torch.long, device=self.kv_cache.device)
                payload.copy_(self.kv_cache.index_select(2, index).permute(2, 0, 1, 3, 4, 5))
            else:  # strided per-block copies straight into the put rows (no temporary)
                for i, b in enumerate(ids):
                    payload[i].copy_(self.kv_cache[:, :, b])
            self._saver.put(SaveJob(request_id, list(keys[lo:lo + n]), buf[:n].numpy(), buffer=buf,
                                    node=node, recheck=recheck))

    def flush(self, request_id: str | None = None) -> Future[SaveResult]:
        """A future resolving to ``request_id``'s ``SaveResult`` once its queued saves are done.

        The saver is FIFO, so the marker resolves after every save queued before it. The
        request's tally is handed over and forgotten.
        """
        return self._saver.flush(request_id)

    def close(self, timeout: float = 10.0) -> None:
        """Finish queued saves (up to ``timeout``) and stop the saver thread."""
        if self._closed:
            return
        self._closed = True
        self._lookups.put(None)
        self._loads.put(None)
        for t in self._io_threads:
            t.join(timeout)
        self._saver.close(timeout)
        if self._placer is not None:
            self._placer.close(timeout)

    def staging_allocations(self) -> int:
        """Host staging buffers allocated so far (pinned on CUDA). Loads and saves reuse pooled
        buffers, so this stops growing once each request size's power of two has been seen."""
        return self._pool.allocations + self._loader.allocations

    @property
    def placer_idle(self) -> bool:
        """No handed-off block waits for its copy to the owners (``engine.kv.handoff``)."""
        return self._placer is None or self._placer.idle

    def stats_snapshot(self) -> ConnectorStats:
        with self._stats_lock:
            out = ConnectorStats(**asdict(self.stats))
        saved = self._saver.snapshot()
        out.saved_blocks, out.saved_bytes, out.save_s = saved.saved_blocks, saved.saved_bytes, saved.save_s
        out.save_failed_blocks, out.handoff_blocks = saved.save_failed_blocks, saved.handoff_blocks
        out.store_errors += saved.store_errors
        if self._placer is not None:
            placed = self._placer.snapshot()
            out.placed_blocks, out.place_dropped_blocks = placed.placed_blocks, placed.dropped_blocks
        return out
