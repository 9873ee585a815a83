# pyright: reportMissingImports=false
"""The store as an SGLang HiCache storage backend (L3 under SGLang's host KV pool).

Loaded by SGLang's ``StorageBackendFactory`` "dynamic" path::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvstore",
        "module_path": "kvstore.integrations.sglang_hicache", "class_name": "KVStoreHiCache",
        "interface_v1": 1, "store": "127.0.0.1:7700"}'

This module imports SGLang (``sglang.srt.mem_cache.hicache_storage``) and nothing else in the
project imports it; it never imports torch itself (the tensors SGLang hands it bring it).

Extra config (the JSON above; SGLang's own keys are ``backend_name``, ``module_path``,
``class_name``, ``interface_v1``):

- ``store``: one daemon, ``"host:port"``; or ``etcd`` (endpoints URL) and ``cluster``
  (default ``"kvstore"``): every node registered there (``kvstore.connect``). Exactly one.
- ``transport``: ``"auto"`` (default: shared memory on the daemon's host, else TCP), ``"tcp"``
  or ``"shm"``; one daemon only (a cluster picks per node).
- ``cluster_secret`` or ``cluster_secret_file``; neither: the client reads
  ``$KVCACHE_CLUSTER_SECRET`` / ``$KVCACHE_CLUSTER_SECRET_FILE`` (``kvstore.secret``).
- ``namespace``: a tag that separates deployments sharing a store (default ``""``).
- ``timeout``: seconds for every connect and socket wait (default 5); ``retry_after``:
  after the store failed a call, calls answer misses without trying it for this long
  (default 1).

Contract (SGLang's ``HiCacheStorage``):

- ``interface_v1: 1`` (the zero-copy path): ``batch_set_v1(keys, host_indices)`` and
  ``batch_get_v1(keys, host_indices)`` -> one bool per page. The host pool's
  ``get_page_buffer_meta(host_indices)`` gives each page's buffers (page_first MHA: K and V;
  MLA: one); each buffer is one store block, put from and got into the host pool's memory as
  it lies (a NumPy view of the pool tensor: no copy on our side; the shared-memory path copies
  once into or out of the daemon's arena, TCP sends and receives in place). A page is True
  when all of its blocks are. A full store fails the pages that did not fit, not the batch
  (the store keeps the batch's leading blocks that fit, ``Client.put``).
- Without ``interface_v1`` SGLang uses the generic calls: ``batch_set(keys, values)`` (the
  pool's flat data pages, True when all were stored), ``batch_get(keys, targets)`` (each
  target tensor filled, or None), ``set``/``get``; these store one block per page.
- ``batch_exists(keys) -> int``: how many leading pages have every block stored;
  ``exists(key)``. Lookups, they never touch recency.
- Failures never reach the engine: a miss is False (None, 0); an unreachable store
  (``StoreUnavailable``), any other ``KVStoreError``, or an error of our own, is False / None
  / 0 for the keys concerned, logged.
- Not supported: the v2 calls (hybrid models' side pools: Mamba, SWA, DSA indexer, DeepSeek V4:
  ``NotImplementedError`` as in the base class), head splitting across TP sizes
  (``tp_lcm_size``: pages are keyed by the writer's TP rank and size, so they are shared only
  by an engine with the same TP), DCP, and ``clear()`` (a no-op: the store is shared).

Key mapping (deterministic: any process with the same configuration and pool finds the same
pages). With ``namespace_id`` of ``kvstore.keys`` (xxh3_128 of a domain tag and the canonical
JSON, spec in that module)::

    ns  = namespace_id({"integration": "sglang-hicache-v1", "namespace": <namespace>,
                        "model": <storage_config.model_name or "">,
                        "tp": "replicated" if is_mla_model else [tp_rank, tp_size],
                        "pp": [pp_rank, pp_size], "cp": [attn_cp_rank, attn_cp_size],
                        "pool": {"class": <host pool class name>, "layout": <layout>,
                                 "dtype": str(dtype), "page_size": <tokens>,
                                 "size_per_token": <bytes>}})
    key(page_key, part) = xxh3_128(ns || page_key.encode("utf-8") || b"\\0" || part).digest()

``part`` is ``b"%d" % i`` for the i-th buffer of a page on the v1 path and ``b"page"`` for
the generic path's flat page, so the two paths never read each other's bytes. MLA pools are
replicated across TP ranks (SGLang's Mooncake backend shares them the same way); the data
parallel rank is not part of the key (a DP group's rank r holds the same heads as another's).
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import xxhash
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

from kvstore import secret
from kvstore.errors import KVStoreError
from kvstore.integrations.lazy_client import LazyClient
from kvstore.keys import namespace_id

__all__ = ["KVStoreHiCache", "namespace_facts", "page_key"]

logger = logging.getLogger(__name__)

_CONFIG_KEYS = {"backend_name", "module_path", "class_name", "interface_v1", "store", "etcd",
                "cluster", "transport", "cluster_secret", "cluster_secret_file", "namespace",
                "timeout", "retry_after", "tp_lcm_size"}
_FLAT = b"page"


def namespace_facts(storage_config: Any, pool: Any, namespace: str = "") -> dict[str, Any]:
    """The facts the namespace id hashes (module docstring): what distinguishes the bytes."""
    c = storage_config
    return {
        "integration": "sglang-hicache-v1",
        "namespace": namespace,
        "model": c.model_name or "",
        "tp": "replicated" if c.is_mla_model else [c.tp_rank, c.tp_size],
        "pp": [c.pp_rank, c.pp_size],
        "cp": [c.attn_cp_rank, c.attn_cp_size],
        "pool": {"class": type(pool).__name__, "layout": str(getattr(pool, "layout", "")),
                 "dtype": str(getattr(pool, "dtype", "")),
                 "page_size": int(pool.page_size),
                 "size_per_token": int(getattr(pool, "size_per_token", 0))},
    }


def page_key(ns: bytes, key: str, part: bytes) -> bytes:
    """The store key of one block of SGLang page ``key`` (module docstring)."""
    return xxhash.xxh3_128(ns + key.encode("utf-8") + b"\0" + part).digest()


def _connect(cfg: dict[str, Any]) -> Any:
    """A ``Client`` or ``ClusterClient`` for the extra config (connects lazily: a store that is
    down at start is a miss, not a failed engine start)."""
    store, etcd = cfg.get("store"), cfg.get("etcd")
    if (store is None) == (etcd is None):
        raise ValueError("kvstore HiCache backend: give exactly one of 'store' (host:port) or "
                         "'etcd' (URL) in --hicache-storage-backend-extra-config")
    token = cfg.get("cluster_secret")
    if token is None and cfg.get("cluster_secret_file"):
        token = secret.read_secret_file(cfg["cluster_secret_file"])
    timeout = float(cfg.get("timeout", 5.0))
    transport = cfg.get("transport", "auto")
    if store is not None:
        from kvstore.client.node import Client, parse_address

        parse_address(store)  # a malformed address fails the start
        if transport not in ("auto", "tcp", "shm"):
            raise ValueError(f"transport must be 'auto', 'tcp' or 'shm', got {transport!r}")
        return LazyClient(lambda: Client(store, auth_token=token, timeout=timeout,
                                          transport=transport))
    if transport != "auto":
        raise ValueError("'transport' applies to one daemon ('store'); a cluster picks per node")
    from kvstore.client.cluster import ClusterClient

    cluster, endpoints = str(cfg.get("cluster", "kvstore")), str(etcd)
    return LazyClient(lambda: ClusterClient(endpoints, cluster=cluster, auth_token=token,
                                             timeout=timeout))


class KVStoreHiCache(HiCacheStorage):
    """SGLang HiCache storage over the kvstore (module docstring: config, contract, keys)."""

    def __init__(self, storage_config: Any, kwargs: Any = None) -> None:
        cfg = dict(getattr(storage_config, "extra_config", None) or {})
        unknown = set(cfg) - _CONFIG_KEYS
        if unknown:  # SGLang may leave options of its own in the dict: a warning, not a failure
            logger.warning("kvstore HiCache backend: extra config keys it does not know: %s",
                           sorted(unknown))
        self.storage_config = storage_config
        self.v1 = bool(int(cfg.get("interface_v1", 0)))
        self.namespace = str(cfg.get("namespace", ""))
        self.retry_after = float(cfg.get("retry_after", 1.0))
        self._store = _connect(cfg)
        self._down_until = 0.0
        self._ns: bytes | None = None
        self._parts = 0          # blocks per page on the v1 path (from the pool's buffer meta)
        self._buffers: list[tuple[int, int, np.ndarray, Any]] = []  # (start, end, bytes, tensor)
        self.mem_pool_host: Any = None

    # --- set-up ------------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """SGLang hands over its host KV pool once, before any call: the namespace (which
        includes the pool's geometry), the blocks per page and the pool's memory as bytes."""
        super().register_mem_pool_host(mem_pool_host)
        pool = mem_pool_host
        self._ns = bytes(namespace_id(namespace_facts(self.storage_config, pool, self.namespace)))
        self._buffers = []
        torch = sys.modules.get("torch")
        for t in _pool_tensors(pool):
            if torch is None or not isinstance(t, torch.Tensor) or t.numel() == 0:
                continue
            if t.device.type != "cpu" or not t.is_contiguous():
                continue  # not host memory we can view: its pages fail (logged on use)
            start = int(t.data_ptr())
            if any(b[0] == start and b[1] == start + t.nbytes for b in self._buffers):
                continue
            flat = t.detach().reshape(-1).view(torch.uint8).numpy()
            self._buffers.append((start, start + flat.nbytes, flat, t))
        self._buffers.sort(key=lambda b: b[0])
        self._parts = 0
        if self.v1 and self._buffers and torch is not None:
            try:
                ptrs, _ = pool.get_page_buffer_meta(torch.arange(pool.page_size, dtype=torch.int64))
                self._parts = len(_flatten(ptrs))
            except Exception:
                logger.exception("kvstore HiCache: the host pool has no usable buffer meta; "
                                 "the v1 calls will fail every page")

    # --- the v1 (zero-copy) path -------------------------------------------------------------

    def batch_set_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
        views = self._page_views(keys, host_indices)
        if views is None:
            return [False] * len(keys)
        held = self._call("put", [False] * len(views), self._block_keys(keys), views)
        return self._per_page(held, len(keys))

    def batch_get_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
        views = self._page_views(keys, host_indices)
        if views is None:
            return [False] * len(keys)
        found = self._call("get", [False] * len(views), self._block_keys(keys), views)
        return self._per_page(found, len(keys))

    # --- lookups -----------------------------------------------------------------------------

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        if not keys or self._ns is None:
            return 0
        present = self._call("contains", [], self._block_keys(keys))
        per_page = self._per_page(present, len(keys)) if present else []
        return per_page.index(False) if False in per_page else len(per_page)

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # --- the generic path (one flat page a block) --------------------------------------------

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        if not keys or values is None or len(values) != len(keys) or self._ns is None:
            return False
        held = self._call("put", [False] * len(keys), [self._flat_key(k) for k in keys],
                          [_contiguous(v) for v in values])
        return all(held)

    def set(self, key: str, value: Any = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[Any]:
        if not keys or target_locations is None or self._ns is None:
            return [None] * len(keys)
        found = self._call("get", [False] * len(keys), [self._flat_key(k) for k in keys],
                           list(target_locations))
        return [t if ok else None for t, ok in zip(target_locations, found)]

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        return self.batch_get([key], [target_location])[0]

    # --- the rest of the interface -----------------------------------------------------------

    @property
    def transport(self) -> str | None:
        """The one daemon's path, ``"shm"`` or ``"tcp"`` (None for a cluster, or while the store
        cannot be reached): for logs and tests."""
        try:
            return getattr(self._store.get(), "transport", None)
        except KVStoreError:
            return None

    def clear(self) -> None:
        """A no-op: the store is shared with other engines and evicts by itself."""

    def close(self) -> None:
        self._store.close()

    # --- helpers -----------------------------------------------------------------------------

    def _block_keys(self, keys: Sequence[str]) -> list[bytes]:
        assert self._ns is not None
        ns = self._ns
        if not self.v1:
            return [page_key(ns, k, _FLAT) for k in keys]
        parts = [b"%d" % i for i in range(self._parts)]
        return [page_key(ns, k, p) for k in keys for p in parts]

    def _flat_key(self, key: str) -> bytes:
        assert self._ns is not None
        return page_key(self._ns, key, _FLAT)

    def _per_page(self, flags: list[bool], pages: int) -> list[bool]:
        m = len(flags) // pages if pages else 0
        if m == 0:
            return [False] * pages
        return [all(flags[i * m:(i + 1) * m]) for i in range(pages)]

    def _page_views(self, keys: list[str], host_indices: Any) -> list[np.ndarray] | None:
        """The host pool's memory of each page's blocks, as writable uint8 views (no copy);
        None when the pool cannot be addressed (every page then fails)."""
        if not keys or self._ns is None or not self._parts:
            return None
        try:
            ptrs, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        except Exception:
            logger.exception("kvstore HiCache: get_page_buffer_meta failed")
            return None
        ptrs, sizes = _flatten(ptrs), _flatten(sizes)
        if len(ptrs) != len(keys) * self._parts or len(sizes) != len(ptrs):
            logger.error("kvstore HiCache: %d buffers for %d pages of %d blocks", len(ptrs),
                         len(keys), self._parts)
            return None
        views = []
        for ptr, size in zip(ptrs, sizes):
            view = self._view(int(ptr), int(size))
            if view is None:
                logger.error("kvstore HiCache: %d bytes at %#x lie in no registered host buffer",
                             size, ptr)
                return None
            views.append(view)
        return views

    def _view(self, ptr: int, size: int) -> np.ndarray | None:
        for start, end, flat, _ in self._buffers:
            if start <= ptr and ptr + size <= end:
                return flat[ptr - start:ptr - start + size]
        return None

    def _call(self, op: str, failed: list[bool], *args: Any) -> list[bool]:
        """``op`` on the store, or ``failed`` when it is down or answers with an error (then
        the store is left alone for ``retry_after`` seconds)."""
        if time.monotonic() < self._down_until:
            return failed
        try:
            return list(getattr(self._store.get(), op)(*args))
        except KVStoreError as exc:
            self._down_until = time.monotonic() + self.retry_after
            logger.warning("kvstore HiCache: %s of %d blocks failed (%s: %s); misses for %.1f s",
                           op, len(args[0]), type(exc).__name__, exc, self.retry_after)
        except Exception:
            logger.exception("kvstore HiCache: %s of %d blocks failed", op, len(args[0]))
        return failed


def _pool_tensors(pool: Any) -> list[Any]:
    """The host pool's tensors that page buffers lie in: what SGLang registers for zero-copy
    I/O (``get_hybrid_pool_buffer()``) and the pool's named buffers."""
    get_buffers = getattr(pool, "get_hybrid_pool_buffer", None)
    tensors = list(get_buffers()) if get_buffers is not None else []
    for name in ("kv_buffer", "k_buffer", "v_buffer", "index_k_buffer", "index_k_scale_buffer"):
        tensors.append(getattr(pool, name, None))
    return [t for t in tensors if t is not None]


def _flatten(items: Sequence[Any]) -> list[Any]:
    """A flat list of a buffer meta list, whose entries may be one pointer or a page's list."""
    out: list[Any] = []
    for item in items:
        if isinstance(item, (list, tuple)):
            out.extend(item)
        else:
            out.append(item)
    return out


def _contiguous(value: Any) -> Any:
    """A value to put as it is when contiguous (a flat page that SGLang sliced may not be)."""
    is_contiguous = getattr(value, "is_contiguous", None)
    return value if is_contiguous is None or is_contiguous() else value.contiguous()
