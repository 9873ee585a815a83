"""The optional GPU tier: blocks in one CUDA byte buffer of the daemon, LRU, below host.

Clients read and write the host arena (shared memory or sockets), so in the daemon this
tier is where host demotes to first when it exists: a GPU copy is far faster than an SSD
write. Its own LRU victims go on down to SSD (or are dropped without one). A get that hits
here copies the block back into the host arena and removes it from the GPU (the tiers
above SSD are exclusive; SSD keeps its copy on promotion, see ``store.py``).

torch is imported only when a ``GpuTier`` is built (``gpu_memory_bytes > 0``); kvstore does
not depend on it otherwise. Space comes from the same best-fit ``Allocator`` as the arena.
Copies are synchronous on the current stream. Not thread-safe: the store calls it under its
lock.
"""

from __future__ import annotations

from collections import OrderedDict

from kvstore.node.allocator import Allocator
from kvstore.keys import BlockKey

__all__ = ["GpuTier", "DEFAULT_DEVICE"]

DEFAULT_DEVICE = "cuda"  # the store's tier lives here; tests run the same code on "cpu"


class GpuTier:
    """``capacity_bytes`` of CUDA memory on ``device`` holding whole blocks."""

    def __init__(self, capacity_bytes: int, device: str | None = None) -> None:
        try:
            import torch
        except ImportError as e:  # pragma: no cover - depends on the machine
            raise RuntimeError("gpu_memory_bytes > 0 needs torch with CUDA; set it to 0") from e
        device = device or DEFAULT_DEVICE
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise RuntimeError("gpu_memory_bytes > 0 but CUDA is not available; set it to 0")
        self._torch = torch
        self.allocator = Allocator(capacity_bytes, granule=256)
        self.capacity = self.allocator.capacity
        self._buf = torch.empty(self.capacity, dtype=torch.uint8, device=device)
        self._lru: OrderedDict[BlockKey, tuple[int, int, int]] = OrderedDict()  # offset, size, checksum
        self.value_bytes = 0

    def __contains__(self, key: BlockKey) -> bool:
        return key in self._lru

    def __len__(self) -> int:
        return len(self._lru)

    def lru_keys(self) -> list[BlockKey]:
        return list(self._lru)

    def put(self, key: BlockKey, checksum: int, data: memoryview | bytes) -> list[tuple[BlockKey, int, bytes]]:
        """Store a block (most recently used); returns LRU victims ``(key, checksum, bytes)``
        that made room for it, for the caller to demote further. A block larger than the tier
        is not stored."""
        size = len(data)
        if key in self._lru or size == 0 or size > self.capacity:
            return []
        victims: list[tuple[BlockKey, int, bytes]] = []
        offset = self.allocator.alloc(size)
        while offset is None:
            vkey, (voff, vsize, vsum) = self._lru.popitem(last=False)
            victims.append((vkey, vsum, self._read(voff, vsize)))
            self.allocator.free(voff)
            self.value_bytes -= vsize
            offset = self.allocator.alloc(size)
        src = self._torch.frombuffer(data, dtype=self._torch.uint8)
        self._buf[offset : offset + size].copy_(src)
        self._lru[key] = (offset, size, checksum)
        self.value_bytes += size
        return victims

    def size_of(self, key: BlockKey) -> int | None:
        rec = self._lru.get(key)
        return None if rec is None else rec[1]

    def take_into(self, key: BlockKey, dst: memoryview) -> int | None:
        """Move ``key`` out of the tier into ``dst``; its checksum, or None on a miss."""
        rec = self._lru.pop(key, None)
        if rec is None:
            return None
        offset, size, checksum = rec
        self._torch.frombuffer(dst, dtype=self._torch.uint8)[:size].copy_(self._buf[offset : offset + size])
        self.allocator.free(offset)
        self.value_bytes -= size
        return checksum

    def delete(self, key: BlockKey) -> bool:
        rec = self._lru.pop(key, None)
        if rec is None:
            return False
        self.allocator.free(rec[0])
        self.value_bytes -= rec[1]
        return True

    def close(self) -> None:
        """Free the device memory; the tier is then empty and holds nothing (capacity 0)."""
        self._lru.clear()
        self.value_bytes = 0
        self.capacity = 0  # put() stores nothing from now on
        self._buf = self._buf.new_empty(0)

    def _read(self, offset: int, size: int) -> bytes:
        return self._buf[offset : offset + size].cpu().numpy().tobytes()
