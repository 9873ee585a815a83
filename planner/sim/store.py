"""The simulated store: which block keys it holds, under a capacity, least recently used out.

The daemon keeps blocks in a host arena of ``--memory`` bytes and evicts the least recently
used when a put does not fit (``kvstore.node``); a get or a lookup touches what it finds. Here
a block costs ``block_bytes`` plus the codec header, keys are the engine's own ``BlockKey`` s
(the same chained hashes the router and the workers compute), and a key is readable once its
save completed (the saver's FIFO finishes it: ``planner.sim.worker``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

__all__ = ["SimStore"]

HEADER_BYTES = 64  # the codec's per-block header, rounded up (kvstore.codec)


class SimStore:
    """Keys under an LRU capacity; ``capacity_blocks`` 0 is a store that holds nothing."""

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 0:
            raise ValueError(f"capacity_blocks must be >= 0, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self._keys: OrderedDict[bytes, None] = OrderedDict()
        self.puts = self.hits = self.evictions = 0

    @classmethod
    def of_bytes(cls, memory_bytes: int, block_bytes: int) -> SimStore:
        return cls(memory_bytes // (block_bytes + HEADER_BYTES) if block_bytes > 0 else 0)

    def __len__(self) -> int:
        return len(self._keys)

    def prefix_len(self, keys: Sequence[bytes]) -> int:
        """Leading ``keys`` held (a lookup: touches them, as the daemon's gets do)."""
        n = 0
        held = self._keys
        for k in keys:
            if k not in held:
                break
            held.move_to_end(k)
            n += 1
        self.hits += n
        return n

    def peek_prefix_len(self, keys: Sequence[bytes]) -> int:
        """Leading ``keys`` held, touching nothing (the router's lookup)."""
        n = 0
        held = self._keys
        for k in keys:
            if k not in held:
                break
            n += 1
        return n

    def put(self, keys: Sequence[bytes]) -> None:
        if not self.capacity_blocks:
            return
        held = self._keys
        for k in keys:
            if k in held:
                held.move_to_end(k)
                continue
            held[k] = None
            self.puts += 1
            if len(held) > self.capacity_blocks:
                held.popitem(last=False)
                self.evictions += 1
