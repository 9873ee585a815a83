"""Drives the kvstore HiCache backend inside real SGLang, in SGLang's own environment.

Run by tests/integrations/test_sglang_hicache.py as ``.venv-sglang/bin/python THIS``: it
imports SGLang's storage interface and ``StorageBackendFactory``, prints one ready line, then
answers one JSON request per stdin line with one JSON line on stdout (``{"ok": value}`` or
``{"error": text}``), until stdin closes.

Backends are made the way SGLang's cache controller makes them:
``StorageBackendFactory.create_backend("dynamic", HiCacheStorageConfig(...), host_pool)`` with
the extra config naming ``kvstore.integrations.sglang_hicache.KVStoreHiCache``, then
``register_mem_pool_host(host_pool)``.

The host pools are this file's: SGLang's own (``sglang.srt.mem_cache.pool_host``) cannot be
imported on a CPU-only machine (docs/integrations.md has the error: its import chain reaches
torchvision, whose PyPI build for torch 2.13 needs CUDA's libraries). ``MHAPool`` and
``MLAPool`` keep SGLang 0.5.23's page_first layouts and the arithmetic of their
``get_page_buffer_meta``, ``get_data_page``, ``get_dummy_flat_data_page`` and
``set_from_flat_data_page`` (pool_host/mha.py, pool_host/mla.py), which is all the backend
uses of a pool.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import sys
import time
from typing import Any

t0 = time.monotonic()
import torch  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

IMPORT_S = time.monotonic() - t0
torch.set_num_threads(1)


class PagePool:
    """What both pools share: page_first, one page = ``page_size`` consecutive tokens."""

    layout = "page_first"
    page_size: int
    dtype: torch.dtype
    kv_buffer: torch.Tensor

    def page(self, index: int) -> torch.Tensor:
        raise NotImplementedError

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        page = self.page(index)
        return page.flatten() if flat else page


class MHAPool(PagePool):
    """SGLang's MHATokenToKVPoolHost, page_first: kv_buffer (2, size, layers, heads, dim)."""

    def __init__(self, size: int, page_size: int, layer_num: int, head_num: int, head_dim: int,
                 dtype: torch.dtype) -> None:
        self.size, self.page_size, self.layer_num = size, page_size, layer_num
        self.head_num, self.head_dim, self.dtype = head_num, head_dim, dtype
        self.size_per_token = head_dim * head_num * layer_num * dtype.itemsize * 2
        self.kv_buffer = torch.zeros((2, size, layer_num, head_num, head_dim), dtype=dtype)

    def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        assert len(indices) % self.page_size == 0
        ptr_list = []
        base = self.kv_buffer.data_ptr()
        idx = indices.tolist()
        item = self.dtype.itemsize
        v_offset = self.layer_num * self.size * self.head_num * self.head_dim * item
        for i in range(0, len(idx), self.page_size):
            k_ptr = base + idx[i] * self.layer_num * self.head_num * self.head_dim * item
            ptr_list += [k_ptr, k_ptr + v_offset]
        element = self.layer_num * item * self.page_size * self.head_num * self.head_dim
        return ptr_list, [element] * len(ptr_list)

    @property
    def k_buffer(self) -> torch.Tensor:
        return self.kv_buffer[0]

    @property
    def v_buffer(self) -> torch.Tensor:
        return self.kv_buffer[1]

    def get_hybrid_pool_buffer(self) -> list[torch.Tensor]:
        return [self.k_buffer, self.v_buffer]

    def page(self, index: int) -> torch.Tensor:
        return self.kv_buffer[:, index:index + self.page_size]

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros((2, self.layer_num, self.page_size, self.head_num, self.head_dim),
                           dtype=self.dtype).flatten()

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        self.kv_buffer[:, index:index + self.page_size] = data_page.reshape(
            2, self.page_size, self.layer_num, self.head_num, self.head_dim)


class MLAPool(PagePool):
    """SGLang's MLATokenToKVPoolHost, page_first: kv_buffer (size, layers, 1, kv_cache_dim)."""

    def __init__(self, size: int, page_size: int, layer_num: int, head_num: int, head_dim: int,
                 dtype: torch.dtype) -> None:
        self.size, self.page_size, self.layer_num = size, page_size, layer_num
        self.kv_cache_dim, self.dtype = head_dim, dtype
        self.size_per_token = head_dim * layer_num * dtype.itemsize
        self.kv_buffer = torch.zeros((size, layer_num, 1, head_dim), dtype=dtype)

    def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        idx = indices.tolist()[::self.page_size]
        item = self.dtype.itemsize
        ptrs = [self.kv_buffer.data_ptr() + i * self.layer_num * self.kv_cache_dim * item
                for i in idx]
        return ptrs, [self.layer_num * item * self.page_size * self.kv_cache_dim] * len(ptrs)

    def page(self, index: int) -> torch.Tensor:
        return self.kv_buffer[index:index + self.page_size]

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros((self.page_size, self.layer_num, 1, self.kv_cache_dim),
                           dtype=self.dtype).flatten()

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        self.kv_buffer[index:index + self.page_size] = data_page.reshape(
            self.page_size, self.layer_num, 1, self.kv_cache_dim)


backends: dict[str, tuple[Any, PagePool]] = {}


def _indices(pool: PagePool, pages: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(p * pool.page_size, (p + 1) * pool.page_size) for p in pages])


def _digests(pool: PagePool, pages: list[int]) -> list[str]:
    return [hashlib.sha256(pool.page(p * pool.page_size).contiguous().view(torch.uint8)
                           .numpy().tobytes()).hexdigest() for p in pages]


def load(name: str, extra_config: dict, tp_rank: int = 0, tp_size: int = 1, mla: bool = False,
         pages: int = 16, page_size: int = 16, layers: int = 2, heads: int = 4, dim: int = 64,
         model: str = "tiny-llama") -> dict:
    pool_cls = MLAPool if mla else MHAPool
    pool = pool_cls(pages * page_size, page_size, layers, heads, dim, torch.bfloat16)
    config = HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=mla, enable_storage_metrics=False, is_page_first_layout=True,
        model_name=model, extra_config=dict(extra_config))
    backend = StorageBackendFactory.create_backend("dynamic", config, pool)
    backend.register_mem_pool_host(pool)
    backends[name] = (backend, pool)
    cls = type(backend)
    return {"class": f"{cls.__module__}.{cls.__qualname__}",
            "is_hicache_storage": isinstance(backend, HiCacheStorage),
            "transport": backend.transport,
            "block_bytes": pool.get_page_buffer_meta(_indices(pool, [0]))[1]}


def fill(name: str, pages: list[int], seed: int) -> list[str]:
    _, pool = backends[name]
    g = torch.Generator().manual_seed(seed)
    for p in pages:
        page = pool.page(p * pool.page_size)
        page.copy_(torch.randint(-30000, 30000, page.shape, generator=g, dtype=torch.int16)
                   .view(pool.dtype))
    return _digests(pool, pages)


def zero(name: str, pages: list[int]) -> None:
    _, pool = backends[name]
    for p in pages:
        pool.page(p * pool.page_size).zero_()


def digests(name: str, pages: list[int]) -> list[str]:
    return _digests(backends[name][1], pages)


def set_v1(name: str, keys: list[str], pages: list[int]) -> list[bool]:
    backend, pool = backends[name]
    return backend.batch_set_v1(keys, _indices(pool, pages))


def get_v1(name: str, keys: list[str], pages: list[int]) -> list[bool]:
    backend, pool = backends[name]
    return backend.batch_get_v1(keys, _indices(pool, pages))


def exists(name: str, keys: list[str]) -> int:
    return backends[name][0].batch_exists(keys)


def set_generic(name: str, keys: list[str], pages: list[int]) -> bool:
    """What SGLang's _generic_page_set does: the pool's flat data pages to batch_set."""
    backend, pool = backends[name]
    return backend.batch_set(keys, [pool.get_data_page(p * pool.page_size) for p in pages])


def get_generic(name: str, keys: list[str], pages: list[int]) -> list[bool]:
    """What SGLang's _generic_page_get does: dummy pages to batch_get, then into the pool."""
    backend, pool = backends[name]
    got = backend.batch_get(keys, [pool.get_dummy_flat_data_page() for _ in pages])
    for p, data in zip(pages, got):
        if data is not None:
            pool.set_from_flat_data_page(p * pool.page_size, data)
    return [data is not None for data in got]


OPS = {f.__name__: f for f in (load, fill, zero, digests, set_v1, get_v1, exists, set_generic,
                               get_generic)}


def main() -> None:
    out = sys.stdout
    out.write(json.dumps({"ready": True, "sglang": importlib.metadata.version("sglang"),
                          "torch": torch.__version__, "import_s": round(IMPORT_S, 2)}) + "\n")
    out.flush()
    for line in sys.stdin:
        req = json.loads(line)
        op = req.pop("op")
        t = time.monotonic()
        try:
            reply = {"ok": OPS[op](**req)}
        except Exception as exc:  # noqa: BLE001 - the test reports it: an exception is what must not happen
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        reply["s"] = round(time.monotonic() - t, 4)
        out.write(json.dumps(reply) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
