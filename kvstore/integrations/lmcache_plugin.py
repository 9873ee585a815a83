"""The store as an LMCache storage plugin: ``KVStorePlugin``.

LMCache (inside vLLM through ``LMCacheConnectorV1``, and inside SGLang) loads it from its
configuration, with nothing patched in LMCache::

    chunk_size: 256
    local_cpu: false
    max_local_cpu_size: 5          # GB; LMCache's allocator for what it stores and retrieves
    storage_plugins: ["kvstore"]
    extra_config:
      storage_plugin.kvstore.module_path: kvstore.integrations.lmcache_plugin
      storage_plugin.kvstore.class_name: KVStorePlugin
      storage_plugin.kvstore.address: "127.0.0.1:7700"   # one daemon, or instead:
      # storage_plugin.kvstore.etcd: "http://127.0.0.1:2379"  (+ .cluster: kvstore)
      # storage_plugin.kvstore.transport: auto | tcp          (auto: shared memory on the host)
      # storage_plugin.kvstore.secret_file: /etc/kvcache/secret  (else $KVCACHE_CLUSTER_SECRET)
      # storage_plugin.kvstore.timeout: 5
      # storage_plugin.kvstore.copy_threads: 2                 (a shared-memory get's copies)

The settings are read under the plugin's own name (``storage_plugin.<name>.*``, the name in
``storage_plugins`` whose ``module_path``/``class_name`` are this class), so two plugins may
point at two stores. The client is ``kvstore.connect``: one daemon by address, or a cluster
through etcd, authenticated with the cluster secret like every other client.

Keys and values: ``kvstore.integrations.lmcache_format`` (its docstring is the spec): a
chunk's key is BLAKE2b-128 of LMCache's key string, its value a 64-byte header followed by
the ``MemoryObj``'s bytes as they are.

A put sends header and tensor as ``Parts`` (no copy to join them). A get allocates the
``MemoryObj`` from LMCache's own allocator (``local_cpu_backend.allocate``) once the header
says its shape, and copies the payload into it straight from the daemon's arena on shared
memory (one copy, the least there can be; a get's chunks are copied on ``copy_threads``
threads, default 2). Over TCP a chunk of the full size (LMCache's metadata says its shape)
is received straight into an object allocated when its size arrives, the header into a small
array beside it (``Sink.landing``), and checked once it is in; another size (the prompt's
last, shorter chunk) lands in a reused staging buffer first. A header that does not parse,
names another key or disagrees with the size or the expected shape is a miss, never bytes
handed to the engine.

Failure is a miss. A dead store, a full one, or an allocation LMCache refuses never raise
into the engine: lookups answer "absent", gets ``None``, puts drop the chunk (a warning at
most every 30 s; ``stats()`` counts each). The store cannot hold blocks for a client, so
``pin`` is a presence check: a chunk evicted between LMCache's lookup and its retrieve is a
miss, which LMCache recomputes. Gets return the leading run of hits, as LMCache's own backends
do.

Puts run on one thread of the plugin's, in submission order, through their own connection;
lookups and gets use another, so a large store never queues a retrieve behind it.
"""
# pyright: reportMissingImports=false

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryFormat, MemoryObj
from lmcache.v1.storage_backend.abstract_backend import StoragePluginInterface

from kvstore.errors import KVStoreError
from kvstore.integrations.lmcache_format import HEADER, decode_header, encode_header, store_key
from kvstore.integrations.store_link import StoreLink, StoreSettings
from kvstore.net.buffers import Parts, Sink

__all__ = ["KVStorePlugin", "PluginSettings", "PluginStats"]

log = logging.getLogger(__name__)

_WARN_EVERY_S = 30.0


@dataclass(frozen=True)
class PluginSettings(StoreSettings):
    """``storage_plugin.<name>.*`` of LMCache's ``extra_config`` (module docstring): where the
    store is (``StoreSettings``, which connects), this plugin's name and its copy threads."""

    name: str = "kvstore"
    copy_threads: int = 2

    @classmethod
    def from_config(cls, config: Any) -> "PluginSettings":
        extra: dict[str, Any] = dict(getattr(config, "extra_config", None) or {})
        names = [n for n in (getattr(config, "storage_plugins", None) or [])
                 if extra.get(f"storage_plugin.{n}.module_path") == __name__
                 and extra.get(f"storage_plugin.{n}.class_name") == KVStorePlugin.__name__]
        name = names[0] if names else "kvstore"
        if len(names) > 1:
            log.warning("storage_plugins %s all load KVStorePlugin; %r's settings are used", names, name)

        def opt(field: str, default: Any = None) -> Any:
            return extra.get(f"storage_plugin.{name}.{field}", default)

        s = cls(name=name, address=opt("address"), etcd=opt("etcd"),
                cluster=str(opt("cluster", "kvstore")), transport=str(opt("transport", "auto")),
                secret_file=opt("secret_file"), timeout=float(opt("timeout", 5.0)),
                copy_threads=int(opt("copy_threads", 2)))
        if (s.address is None) == (s.etcd is None):
            raise ValueError(f"set exactly one of storage_plugin.{name}.address or "
                             f"storage_plugin.{name}.etcd in LMCache's extra_config")
        if s.transport not in ("auto", "tcp"):
            raise ValueError(f"storage_plugin.{name}.transport must be 'auto' or 'tcp'")
        return s


@dataclass(frozen=True)
class _FullChunk:
    """What a full chunk of this engine is (LMCache's metadata): a TCP get receives its
    payload straight into a ``MemoryObj`` allocated before the header arrives."""

    shape: torch.Size
    dtype: torch.dtype
    fmt: MemoryFormat

    @property
    def block_bytes(self) -> int:
        return HEADER.size + int(np.prod(self.shape)) * self.dtype.itemsize


class _ChunkSink(Sink):
    """Receives one stored chunk into a ``MemoryObj`` of LMCache's allocator, its header
    checked first. On shared memory: where the block lies (``consume_all`` copies a get's
    chunks on the plugin's threads); over TCP a full chunk lands in the object directly
    (``landing``), anything else through the staging buffer (``consume``)."""

    __slots__ = ("skey", "plugin", "obj", "_head")

    def __init__(self, staging: np.ndarray, skey: bytes, plugin: "KVStorePlugin") -> None:
        super().__init__(staging)
        self.skey, self.plugin = skey, plugin
        self.obj: MemoryObj | None = None
        self._head: np.ndarray | None = None

    def _open(self, head: np.ndarray, size: int) -> np.ndarray | None:
        """Check the header, allocate the object; its payload as flat uint8, or None."""
        meta = decode_header(head, self.skey, size)
        if meta is None:
            self.plugin._warn("kvstore: a chunk came back with a bad header; treated as a miss")
            return None
        fmt, shape, dtype = meta
        obj = self.plugin._allocate(shape, dtype, fmt)
        if obj is None:
            return None
        if obj.tensor is None:
            obj.ref_count_down()
            return None
        self.obj = obj
        return obj.tensor.view(-1).view(torch.uint8).numpy()

    def consume(self, block: np.ndarray) -> None:
        dst = self._open(block[:HEADER.size], len(block))
        if dst is not None:
            np.copyto(dst, block[HEADER.size:])

    @classmethod
    def consume_all(cls, work: list[tuple[Sink, np.ndarray]]) -> None:
        """Headers and allocations in key order, then the copies over the plugin's threads
        (NumPy lets go of the GIL while it copies)."""
        copies = []
        pool = None
        for sink, block in work:
            assert isinstance(sink, _ChunkSink)
            pool = sink.plugin._copiers
            dst = sink._open(block[:HEADER.size], len(block))
            if dst is not None:
                copies.append((dst, block[HEADER.size:]))
        if pool is None or len(copies) < 2:
            for dst, src in copies:
                np.copyto(dst, src)
            return
        for f in [pool.submit(np.copyto, dst, src) for dst, src in copies]:
            f.result()

    def landing(self, size: int) -> list[np.ndarray] | None:
        full = self.plugin._full
        if full is None or size != full.block_bytes:
            return None
        obj = self.plugin._allocate(full.shape, full.dtype, full.fmt)
        if obj is None or obj.tensor is None:
            if obj is not None:
                obj.ref_count_down()
            return None
        self.obj, self._head = obj, np.empty(HEADER.size, np.uint8)
        return [self._head, obj.tensor.view(-1).view(torch.uint8).numpy()]

    def landed(self, size: int) -> None:
        assert self._head is not None and self.obj is not None and self.plugin._full is not None
        full = self.plugin._full
        if decode_header(self._head, self.skey, size) != (full.fmt, full.shape, full.dtype):
            self.plugin._warn("kvstore: a chunk came back with a bad header; treated as a miss")
            self.obj.ref_count_down()
            self.obj = None


@dataclass
class PluginStats:
    unavailable: int = 0  # calls that found the store unreachable (answered as misses)
    hits: int = 0
    misses: int = 0
    get_errors: int = 0
    stored: int = 0
    put_dropped: int = 0
    put_errors: int = 0


def _full_chunk(metadata: Any) -> _FullChunk | None:
    """A full chunk's shape, dtype and format from LMCache's metadata (None if it says none)."""
    try:
        shapes, dtypes = metadata.get_shapes(), metadata.get_dtypes()
    except (AttributeError, TypeError):
        return None
    if len(shapes) != 1 or len(dtypes) != 1:
        return None
    fmt = MemoryFormat.KV_MLA_FMT if getattr(metadata, "use_mla", False) else MemoryFormat.KV_2LTD
    return _FullChunk(torch.Size(shapes[0]), dtypes[0], fmt)


class KVStorePlugin(StoragePluginInterface):
    """LMCache's ``StoragePluginInterface`` over a kvstore daemon or cluster (module docstring)."""

    def __init__(self, dst_device: str = "cpu", config: Any = None, metadata: Any = None,
                 local_cpu_backend: Any = None, loop: asyncio.AbstractEventLoop | None = None) -> None:
        super().__init__(dst_device=dst_device, config=config, metadata=metadata,
                         local_cpu_backend=local_cpu_backend, loop=loop)
        if local_cpu_backend is None:
            raise ValueError("KVStorePlugin allocates from LMCache's local_cpu_backend; none was given")
        self.settings = PluginSettings.from_config(config)
        self._reader, self._writer = StoreLink(self.settings), StoreLink(self.settings)
        self._puts = ThreadPoolExecutor(1, thread_name_prefix="kvstore-lmcache-put")
        self._put_lock = threading.Lock()
        self._put_tasks: set[CacheEngineKey] = set()
        self._staging = np.empty(0, np.uint8)
        self._full = _full_chunk(metadata)
        self._copiers = ThreadPoolExecutor(copy_threads, thread_name_prefix="kvstore-lmcache-copy") \
            if (copy_threads := self.settings.copy_threads) > 1 else None
        self._warned_at = 0.0
        self.stats = PluginStats()

    def __str__(self) -> str:
        return f"KVStorePlugin({self.settings.address or self.settings.etcd})"

    # --- lookups ---------------------------------------------------------------------------

    def _present(self, keys: Sequence[CacheEngineKey]) -> list[bool]:
        client = self._reader.get()
        if client is None:
            self.stats.unavailable += 1
            return [False] * len(keys)
        try:
            return client.contains([store_key(k) for k in keys])
        except KVStoreError as exc:
            self._drop(self._reader, exc)
            self.stats.unavailable += 1
            return [False] * len(keys)

    def contains(self, key: CacheEngineKey, pin: bool = False) -> bool:
        return self._present([key])[0]

    def batched_contains(self, keys: list[CacheEngineKey], pin: bool = False) -> int:
        n = 0
        for present in self._present(keys):
            if not present:
                break
            n += 1
        return n

    async def batched_async_contains(self, lookup_id: str, keys: list[CacheEngineKey],
                                     pin: bool = False) -> int:
        return await asyncio.to_thread(self.batched_contains, keys, pin)

    def exists_in_put_tasks(self, key: CacheEngineKey) -> bool:
        with self._put_lock:
            return key in self._put_tasks

    def pin(self, key: CacheEngineKey) -> bool:
        return self.contains(key)

    def unpin(self, key: CacheEngineKey) -> bool:
        return True

    # --- gets ------------------------------------------------------------------------------

    def _allocate(self, shape: torch.Size, dtype: torch.dtype, fmt: MemoryFormat) -> Optional[MemoryObj]:
        return self.local_cpu_backend.allocate(shape, dtype, fmt)

    def batched_get_blocking(self, keys: list[CacheEngineKey]) -> list[Optional[MemoryObj]]:
        """The leading run of hits as ``MemoryObj``s of LMCache's allocator, None after."""
        if not keys:
            return []
        client = self._reader.get()
        if client is None:
            self.stats.unavailable += 1
            self.stats.misses += len(keys)
            return [None] * len(keys)
        skeys = [store_key(k) for k in keys]
        if not self._staging.nbytes:  # a block lands here over TCP (never touched on shm)
            self._staging = np.empty(HEADER.size + self.local_cpu_backend.get_full_chunk_size_bytes(),
                                     np.uint8)
        sinks = [_ChunkSink(self._staging, k, self) for k in skeys]
        try:
            client.get(skeys, sinks)
        except (KVStoreError, ValueError) as exc:
            self._drop(self._reader, exc)
            for s in sinks:
                if s.obj is not None:
                    s.obj.ref_count_down()
            self.stats.get_errors += 1
            return [None] * len(keys)
        out: list[Optional[MemoryObj]] = []
        leading = True
        for s in sinks:
            leading = leading and s.obj is not None
            if leading:
                out.append(s.obj)
            else:  # a miss, or a hit after one: LMCache takes the leading run
                if s.obj is not None:
                    s.obj.ref_count_down()
                out.append(None)
        hits = len(out) - out.count(None)
        self.stats.hits += hits
        self.stats.misses += len(keys) - hits
        return out

    def get_blocking(self, key: CacheEngineKey) -> Optional[MemoryObj]:
        return self.batched_get_blocking([key])[0]

    def get_non_blocking(self, key: CacheEngineKey, location: Optional[str] = None) -> Optional[Future]:
        f: Future = Future()
        f.set_result(self.get_blocking(key))
        return f

    async def batched_get_non_blocking(self, lookup_id: str, keys: list[CacheEngineKey],
                                       transfer_spec: Any = None) -> list[MemoryObj]:
        objs = await asyncio.to_thread(self.batched_get_blocking, keys)
        return [o for o in objs if o is not None]

    # --- puts ------------------------------------------------------------------------------

    def batched_submit_put_task(self, keys: Sequence[CacheEngineKey], objs: list[MemoryObj],
                                transfer_spec: Any = None,
                                on_complete_callback: Optional[Callable[[CacheEngineKey], None]] = None,
                                ) -> Optional[list[Future]]:
        batch: list[tuple[CacheEngineKey, MemoryObj, bytes]] = []
        for key, obj in zip(keys, objs):
            meta = obj.metadata
            tensor = obj.tensor
            if tensor is None or (meta.shapes is not None and len(meta.shapes) > 1):
                self.stats.put_dropped += 1
                continue
            skey = store_key(key)
            try:
                header = encode_header(skey, meta.fmt, tuple(tensor.shape), tensor.dtype)
            except ValueError as exc:
                self._warn(f"kvstore: a chunk cannot be stored: {exc}")
                self.stats.put_dropped += 1
                continue
            with self._put_lock:
                if key in self._put_tasks:
                    continue
                self._put_tasks.add(key)
            obj.ref_count_up()
            batch.append((key, obj, header))
        if not batch:
            return None
        return [self._puts.submit(self._put, batch, on_complete_callback)]

    def _put(self, batch: list[tuple[CacheEngineKey, MemoryObj, bytes]],
             on_complete: Optional[Callable[[CacheEngineKey], None]]) -> None:
        try:
            client = self._writer.get()
            held = [False] * len(batch)
            if client is None:
                self.stats.unavailable += 1
            else:
                try:
                    held = client.put([store_key(k) for k, _, _ in batch],
                                      [Parts(h, o.tensor) for _, o, h in batch])
                except KVStoreError as exc:
                    self._drop(self._writer, exc)
                    self.stats.put_errors += 1
            stored = sum(held)
            self.stats.stored += stored
            self.stats.put_dropped += len(batch) - stored
            if stored < len(batch):
                self._warn(f"kvstore: {len(batch) - stored} of {len(batch)} chunks were not stored "
                           "(store full or unreachable)")
            if on_complete is not None:
                for (key, _, _), ok in zip(batch, held):
                    if ok:
                        try:
                            on_complete(key)
                        except Exception as exc:  # noqa: BLE001 - LMCache's callback: log, as its backends do
                            log.warning("on_complete_callback failed for %s: %s", key, exc)
        finally:
            for key, obj, _ in batch:
                obj.ref_count_down()
                with self._put_lock:
                    self._put_tasks.discard(key)

    # --- removal, allocator, lifecycle -------------------------------------------------------

    def remove(self, key: CacheEngineKey, force: bool = True) -> bool:
        return self.batched_remove([key], force) == 1

    def batched_remove(self, keys: list[CacheEngineKey], force: bool = True) -> int:
        client = self._writer.get()
        if client is None:
            return 0
        try:
            return client.delete([store_key(k) for k in keys])
        except KVStoreError as exc:
            self._drop(self._writer, exc)
            return 0

    def get_allocator_backend(self) -> Any:
        return self.local_cpu_backend

    def touch_cache(self) -> None:
        """Recency is the store's own (every get touches its blocks)."""

    def close(self) -> None:
        """Finish the queued puts (up to the store's timeout each), then disconnect."""
        self._puts.shutdown(wait=True)
        if self._copiers is not None:
            self._copiers.shutdown(wait=True)
        self._reader.close()
        self._writer.close()

    def _drop(self, link: StoreLink, exc: Exception) -> None:
        self._warn(f"kvstore at {self.settings.address or self.settings.etcd}: {exc}")
        link.close()

    def _warn(self, message: str) -> None:
        now = time.monotonic()
        if now - self._warned_at >= _WARN_EVERY_S:
            self._warned_at = now
            log.warning("%s", message)
