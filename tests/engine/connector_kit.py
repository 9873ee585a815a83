"""What the connector's tests share: the cache's shape, a paged cache, and ``DictStore``, an
in-memory stand-in with the client's batch API (the connector is the unit under test; the
path against a real daemon is in test_disagg.py). Their fixtures (``load_path``, ``keys``) are
in this package's ``conftest.py``."""

from __future__ import annotations

import threading

import numpy as np
import torch

from kvstore.errors import StoreUnavailable
from kvstore.net.buffers import Sink

__all__ = ["L", "BS", "H", "D", "NB", "DictStore", "make_cache"]

L, BS, H, D, NB = 3, 4, 2, 8, 16


class DictStore:
    """Client stand-in: put/get/get_bytes/prefix_len over a dict, thread-safe."""

    def __init__(self) -> None:
        self.data: dict[bytes, bytes] = {}
        self.lock = threading.Lock()
        self.puts = 0
        self.down = False

    def _check(self) -> None:
        if self.down:
            raise StoreUnavailable("test store is down")

    def put(self, keys, values) -> list[bool]:
        self._check()
        with self.lock:
            self.puts += 1
            for k, v in zip(keys, values, strict=True):
                self.data[bytes(k)] = bytes(memoryview(v).cast("B"))
        return [True] * len(keys)

    def get(self, keys, buffers) -> list[bool]:
        self._check()
        out, sunk = [], []
        for k, b in zip(keys, buffers, strict=True):
            v = self.data.get(bytes(k))
            if v is not None:
                if isinstance(b, Sink):  # consumed where it lies, as the shm path does
                    sunk.append((b, np.frombuffer(v, np.uint8)))
                else:
                    memoryview(b).cast("B")[: len(v)] = v
            out.append(v is not None)
        if sunk:
            type(sunk[0][0]).consume_all(sunk)
        return out

    def contains(self, keys) -> list[bool]:
        self._check()
        return [bytes(k) in self.data for k in keys]

    def prefix_len(self, keys) -> int:
        self._check()
        n = 0
        for k in keys:
            if bytes(k) not in self.data:
                break
            n += 1
        return n


def make_cache(dtype=torch.float32, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((L, 2, NB, BS, H, D), generator=g).to(dtype)
