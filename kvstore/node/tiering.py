"""Moving blocks between one node's tiers: demotion under the watermarks, promotion on a pin.

``BlockStore`` (``store.py``) owns the index, the lock and the API; ``Tiering`` owns where a
block goes when the host arena fills and how a lower-tier hit comes back up:

- Demotion: least-recently-used host blocks go to the GPU tier if any, else to SSD, else they
  are evicted. ``relieve_pressure`` (after a commit or promotion left occupancy above the high
  watermark) runs on the caller's thread down to the low watermark; its SSD writes run
  *outside* the lock (the victims carry the store's own pin meanwhile, so readers keep
  reading them), in LMDB transactions of at most ``DEMOTE_CHUNK`` bytes.
  ``make_room_locked`` is the synchronous form for a reserve that does not fit.
- Promotion: a GPU hit moves up under the lock (GPU is exclusive). An SSD hit is read outside
  the lock into a slot reserved for it and keeps its SSD copy (SSD is inclusive: a block
  demoted again needs no second write, and the copy survives restarts).

Methods ending in ``_locked`` must be called with the store's lock held; the others take it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import lmdb

from kvstore.keys import BlockKey
from kvstore.node.arena import Arena
from kvstore.node.host_tier import HostEntry, HostIndex
from kvstore.node.ssd_tier import SsdTier
from kvstore.node.stats import StoreStats

if TYPE_CHECKING:
    from kvstore.node.gpu_tier import GpuTier

__all__ = ["Tiering", "DEMOTE_CHUNK"]

log = logging.getLogger(__name__)

DEMOTE_CHUNK = 64 << 20  # bytes per demotion transaction


class Tiering:
    """The demotion/promotion policy over one store's tiers (see the module docstring)."""

    def __init__(self, host: HostIndex, gpu: GpuTier | None, ssd: SsdTier | None, arena: Arena,
                 lock: threading.Lock, counters: StoreStats, high_bytes: int, low_bytes: int
                 ) -> None:
        self._host, self._gpu, self._ssd, self._arena = host, gpu, ssd, arena
        self._lock = lock
        self._s_host, self._s_gpu, self._s_ssd = counters.host, counters.gpu, counters.ssd
        self._high, self._low = high_bytes, low_bytes
        self._spilling = False
        self.closed = False  # set by the store's close (under the lock): demotion stops

    # -- promotion ------------------------------------------------------------------------

    def reserve_slot_locked(self, key: BlockKey, size: int) -> HostEntry | None:
        """An owner-less reservation for a promotion, making room if needed; None if no room."""
        if self._host.allocator.rounded(size) > self._host.capacity:
            return None
        entry = self._host.reserve(key, size, None)
        while entry is None:
            if not self.make_room_locked(size):
                return None
            entry = self._host.reserve(key, size, None)
        return entry

    def promote_from_gpu_locked(self, key: BlockKey, owner: Hashable | None) -> HostEntry | None:
        """Move ``key`` from the GPU tier into the arena, pinned for ``owner``; None if it
        is not there or does not fit."""
        gpu, stats = self._gpu, self._s_gpu
        assert gpu is not None and stats is not None, "the store has no GPU tier"
        size = gpu.size_of(key)
        if size is None:
            stats.misses += 1
            return None
        slot = self.reserve_slot_locked(key, size)
        if slot is None:
            stats.misses += 1
            return None
        c = gpu.take_into(key, self._arena.buf[slot.offset : slot.offset + size])
        assert c is not None, "the block left the GPU tier under the lock"
        self._host.commit(slot, c, pin_owner=owner, pinned=True)
        stats.hits += 1
        stats.bytes_out += size
        self._count_promotion(size)
        return slot

    def promote_from_ssd(self, slots: list[tuple[HostEntry, int]], owner: Hashable | None
                         ) -> list[bool]:
        """Read SSD blocks into their reserved ``(slot, checksum)``s outside the lock, then
        commit them pinned for ``owner``; which ones arrived (a damaged one is a miss)."""
        ssd, stats = self._ssd, self._s_ssd
        assert ssd is not None and stats is not None, "the store has no SSD tier"
        buf = self._arena.buf
        ok = [ssd.read_into(e.key, buf[e.offset : e.offset + e.size]) for e, _ in slots]
        with self._lock:
            for (e, c), good in zip(slots, ok):
                if not good:
                    self._host.abort(e)
                    stats.misses += 1
                    continue
                e.on_ssd = True
                self._host.commit(e, c, pin_owner=owner, pinned=True)
                stats.hits += 1
                stats.bytes_out += e.size
                self._count_promotion(e.size)
            pressure = self.over_high_locked()
        if pressure:
            self.relieve_pressure()
        return ok

    def _count_promotion(self, size: int) -> None:
        self._s_host.promotions += 1
        self._s_host.bytes_in += size
        self._s_host.bytes_out += size

    # -- demotion and eviction ------------------------------------------------------------

    def over_high_locked(self) -> bool:
        """Host occupancy is above the high watermark: call ``relieve_pressure`` (unlocked)."""
        return self._host.used_bytes > self._high

    def make_room_locked(self, size: int) -> bool:
        """Synchronously demote/evict LRU blocks worth ``size`` bytes; False if none is evictable."""
        victims = self._take_victims_locked(size)
        if not victims:
            return False
        written = self._write_lower(victims)
        for e in victims:
            self._host.remove(e)
        self._account(victims, written)
        return True

    def relieve_pressure(self) -> None:
        """Demote (or evict) LRU blocks until host occupancy is at most the low watermark."""
        with self._lock:
            if self._spilling or self.closed:
                return
            self._spilling = True
        try:
            while True:
                with self._lock:
                    excess = self._host.used_bytes - self._low
                    if excess <= 0 or self.closed:
                        return
                    victims = self._take_victims_locked(min(excess, DEMOTE_CHUNK))
                    if not victims:
                        return
                    if self._ssd is None or self._gpu is not None:
                        # no I/O worth leaving the lock for: evict or copy to GPU in place
                        written = self._write_lower(victims)
                        for e in victims:
                            self._host.remove(e)
                        self._account(victims, written)
                        continue
                    for e in victims:
                        self._host.pin(e, None)  # the store's own pin: readers may still pin
                written = self._write_lower(victims)
                with self._lock:
                    for e in victims:
                        if written.ok:
                            e.on_ssd = True
                        doomed = e.doomed
                        self._host.release_and_free(e)
                        if doomed and written.ok:
                            self._ssd.delete([e.key])
                    self._account(victims, written)
        finally:
            with self._lock:
                self._spilling = False

    def _take_victims_locked(self, nbytes: int) -> list[HostEntry]:
        """Pop LRU entries totalling at least ``nbytes`` (at least one if any)."""
        victims: list[HostEntry] = []
        taken = 0
        while taken < nbytes or not victims:
            e = self._host.pop_lru()
            if e is None:
                break
            victims.append(e)
            taken += e.size
        return victims

    def _write_lower(self, victims: list[HostEntry]) -> _Written:
        """Copy victims (pinned or out of the LRU, hence stable) to the tiers below.

        ``ok``: they now live in a lower tier (else they are to be evicted). The GPU part runs
        under the lock (its callers hold it); the SSD part may run without it, so counters are
        returned and applied under the lock by ``_account``.
        """
        w = _Written(ok=self._ssd is not None or self._gpu is not None)
        if not w.ok:
            return w
        buf = self._arena.buf
        down: list[tuple[BlockKey, int, memoryview | bytes]] = []
        for e in victims:
            if e.on_ssd:
                continue
            view = buf[e.offset : e.offset + e.size]
            if self._gpu is not None:
                spilled = self._gpu.put(e.key, e.checksum, view)
                w.gpu_bytes += e.size
                w.gpu_spilled += len(spilled)
                down.extend(spilled)
            else:
                down.append((e.key, e.checksum, view))
        if self._ssd is None or not down:
            return w
        try:
            w.ssd_evicted = len(self._ssd.put_many(down))
        except lmdb.Error as exc:
            log.warning("SSD write of %d blocks failed (%s); evicting them instead", len(down), exc)
            w.ok = False
            return w
        w.ssd_bytes = sum(len(b) for _, _, b in down)
        return w

    def _account(self, victims: list[HostEntry], w: _Written) -> None:
        if w.ok:
            self._s_host.demotions += len(victims)
        else:
            self._s_host.evictions += len(victims)
        if self._s_gpu is not None:
            self._s_gpu.bytes_in += w.gpu_bytes
            if self._ssd is not None:
                self._s_gpu.demotions += w.gpu_spilled
            else:
                self._s_gpu.evictions += w.gpu_spilled
        if self._s_ssd is not None:
            self._s_ssd.bytes_in += w.ssd_bytes
            self._s_ssd.evictions += w.ssd_evicted


@dataclass(slots=True)
class _Written:
    """What one ``_write_lower`` did, for the counters."""

    ok: bool
    gpu_bytes: int = 0
    gpu_spilled: int = 0
    ssd_bytes: int = 0
    ssd_evicted: int = 0
