"""``GpuShare``: the GPU tier's blocks handed to same-host processes over CUDA IPC.

The daemon exports its tier buffer once (``kvstore.node.cuda_ipc``); a client maps it and
copies device to device at the offsets these calls give, as the shared-memory path does in
the arena (``store.py``'s RESERVE/COMMIT/PIN/UNPIN):

- ``pin(keys, owner)``: (offset, size) of blocks committed in the GPU tier, pinned for
  ``owner`` (never an LRU victim; one that leaves the tier meanwhile keeps its space until
  the last unpin); None where a key is not in the GPU tier (host- or SSD-resident blocks
  are read through the host paths). ``unpin`` ends the read.
- ``reserve(items, owner)``: tier offsets to write into, all or nothing, None where the key
  is present in some tier (nothing to write); making room takes unpinned LRU blocks, which go
  on to SSD when there is one. ``commit`` makes them visible, ``abort`` drops them. One owner
  holds at most ``max_reserve`` bytes reserved (half the tier), so one client cannot hold the
  whole tier before it wrote a byte.
- ``BlockStore.release_owner`` also drops the owner's GPU pins and reservations (the daemon
  calls it when a connection ends).

Calls take the store's lock; bytes move outside the daemon entirely (the client copies).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Any

from kvstore.errors import StoreFull
from kvstore.keys import BlockKey
from kvstore.node import cuda_ipc

if TYPE_CHECKING:
    from kvstore.node.gpu_tier import GpuTier
    from kvstore.node.ssd_tier import SsdTier
    from kvstore.node.stats import TierStats

__all__ = ["GpuShare", "GpuPinError"]

log = logging.getLogger(__name__)


class GpuPinError(KeyError):
    """unpin/commit of keys this owner has not pinned/reserved: a caller bug."""


class GpuShare:
    """Pins and reservations on one store's GPU tier (module docstring)."""

    def __init__(self, gpu: GpuTier, lock: threading.Lock, present: Callable[[BlockKey], bool],
                 ssd: SsdTier | None, stats: TierStats) -> None:
        self._gpu, self._lock, self._present, self._ssd, self._stats = gpu, lock, present, ssd, stats
        self.max_reserve = max(1, gpu.capacity // 2)
        self._handle: dict[str, Any] | None = None

    @property
    def is_cuda(self) -> bool:
        """Whether the tier is CUDA memory (IPC is offered only then)."""
        return self._gpu.is_cuda

    def handle(self) -> dict[str, Any]:
        """The tier buffer's CUDA IPC handle (exported once); ``Unsupported`` off CUDA."""
        with self._lock:
            if self._handle is None:
                self._handle = {**cuda_ipc.export(self._gpu.buffer), "max_reserve": self.max_reserve}
            return self._handle

    def pin(self, keys: Sequence[BlockKey], owner: Hashable) -> list[tuple[int, int] | None]:
        with self._lock:
            slots = self._gpu.pin(keys, owner)
            out: list[tuple[int, int] | None] = []
            for s in slots:
                if s is None:
                    self._stats.misses += 1
                    out.append(None)
                else:
                    self._stats.hits += 1
                    self._stats.bytes_out += s.size
                    out.append((s.offset, s.size))
            return out

    def unpin(self, keys: Sequence[BlockKey], owner: Hashable) -> None:
        with self._lock:
            try:
                self._gpu.unpin(keys, owner)
            except KeyError as e:
                raise GpuPinError(f"GPU unpin of {e.args[0]!r}, which this owner has not pinned") from None

    def reserve(self, items: Sequence[tuple[BlockKey, int]], owner: Hashable) -> list[int | None]:
        items = list(items)
        total = sum(s for _, s in items)
        with self._lock:
            held = self._gpu.reserved_bytes(owner)
            if held + total > self.max_reserve:
                raise StoreFull(f"a GPU reserve of {total} bytes would hold {held + total} bytes "
                                f"reserved on this connection, over its {self.max_reserve}-byte cap "
                                "(half the GPU tier); commit first or reserve fewer blocks at once")
            want = [i for i, (k, _) in enumerate(items) if not self._present(k)]
            slots, victims = self._gpu.reserve([items[i] for i in want], owner)
            self._spill(victims)
            if slots is None:
                raise StoreFull(f"cannot fit {total} bytes in {len(items)} blocks in the GPU tier: "
                                "the rest is pinned or being written; retry later or put fewer blocks")
            out: list[int | None] = [None] * len(items)
            for i, slot in zip(want, slots):
                out[i] = None if slot is None else slot.offset
            return out

    def commit(self, keys: Sequence[BlockKey], owner: Hashable) -> int:
        with self._lock:
            try:
                nbytes = self._gpu.commit(keys, owner)
            except KeyError:
                raise GpuPinError("GPU commit of keys this owner has not reserved") from None
            self._stats.bytes_in += nbytes
            return nbytes

    def abort(self, keys: Sequence[BlockKey], owner: Hashable) -> None:
        with self._lock:
            if not self._gpu.reserved_by(keys, owner):
                raise GpuPinError("GPU abort of keys this owner has not reserved")
            self._gpu.abort(keys, owner)

    def _spill(self, victims: list[tuple[BlockKey, int, bytes]]) -> None:
        """LRU victims of a reserve: on to SSD when there is one, else evicted."""
        if not victims:
            return
        if self._ssd is not None:
            try:
                self._ssd.put_many(victims)
                self._stats.demotions += len(victims)
                return
            except Exception as e:  # noqa: BLE001 - lmdb.Error and kin: a cache drops them
                log.warning("SSD write of %d GPU blocks failed (%s); evicting them", len(victims), e)
        self._stats.evictions += len(victims)
