"""BlockStore: one node's tiers (host arena, optional GPU, optional SSD) and their policy.

Contract (``docs/architecture.md``, "BlockStore"), and the decisions behind it:

- Blocks are immutable byte strings under a ``BlockKey``. ``reserve`` allocates arena slots
  for a batch, all or nothing; ``None`` for a key that is present in any tier or being
  written (a put of it is a successful no-op; a key repeated within a batch is reserved once).
  The caller copies bytes into ``arena.buf[offset:offset+size]`` *outside* the store's lock,
  then ``commit``s (or ``abort``s). ``pin`` returns host locations to read from, promoting
  GPU/SSD hits into the arena first; ``unpin`` ends the read.
- A pinned or reserved block is never evicted. Reservations and pins may carry an ``owner``
  token (e.g. a connection); ``release_owner`` aborts its reservations and drops its pins,
  the GPU tier's CUDA IPC ones included (``gpu_share``, ``kvstore.node.gpu_share``).
- Recency: batch calls touch their keys from last to first, so a prefix's tail is evicted
  before its head. ``contains``/``prefix_len`` never touch recency.
- Watermarks: when a commit (or a promotion) leaves host occupancy above ``high_watermark``,
  the caller's thread demotes least-recently-used blocks down to ``low_watermark``: to the
  GPU tier if any, else to SSD, else they are evicted. SSD writes for this run *outside* the
  lock (the victims are pinned by the store meanwhile, so readers keep reading them).
  How blocks move between tiers lives in ``tiering.py``; this module owns the index and API.
- A reserve that does not fit demotes/evicts synchronously under the lock (rare when the
  watermarks do their job); if nothing evictable is left it raises ``StoreFull`` and
  reserves nothing.
- Promotion from SSD keeps the SSD copy (SSD is inclusive): a block demoted again later
  needs no second write, and the SSD copy survives restarts. GPU is exclusive (moved up).
  The SSD read of a promotion runs outside the lock into a slot reserved for it; a
  concurrent pin of the same key meanwhile is a miss.
- A delete of a pinned block hides it at once and frees it at its last unpin; a put of that
  key before then is a no-op (the key reads as missing): a cache may drop a block.
- The shared-memory index (``shared_index``, ``kvstore.node.shared_index``): committed host
  blocks are published for same-host clients to read with no round trip, and retracted
  before their space is reused or freed (``host_tier.py`` does both under the lock). Such
  reads come back as ``touch(keys, counts, sizes)``: recency (in the order given, the last
  the most recent) and the hit counters. ``index`` is None when the config turns it off or
  no correct writer exists here.

Thread-safe: one lock guards the index; payload bytes are copied outside it.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

from kvstore.errors import KVStoreError, StoreFull, StoreUnavailable
from kvstore.keys import BlockKey
from kvstore.node.arena import Arena
from kvstore.node.gpu_share import GpuShare
from kvstore.node.host_tier import EntryState, HostEntry, HostIndex
from kvstore.node.shared_index import SharedIndex
from kvstore.node.ssd_tier import CorruptSsdPolicy, SsdTier, checksum
from kvstore.node.stats import StoreStats, TierStats
from kvstore.node.tiering import Tiering

__all__ = ["StoreConfig", "BlockStore", "Location", "Reservation", "ReservationError",
           "StoreStats", "TierStats"]

GRANULE = 64  # arena allocation unit; payload offsets are 64-byte aligned


@dataclass(frozen=True)
class StoreConfig:
    """One node's store. ``ssd_capacity_bytes`` 0 with an ``ssd_path``: half the disk's free space."""

    memory_bytes: int
    ssd_path: str | None = None
    ssd_capacity_bytes: int = 0
    gpu_memory_bytes: int = 0
    high_watermark: float = 0.95
    low_watermark: float = 0.85
    shm_name: str | None = None
    on_corrupt_ssd: CorruptSsdPolicy = "move-aside"  # a damaged SSD tier (ssd_tier.py)
    shared_index: bool = True  # publish the host tier's index in shared memory (shared_index.py)

    def __post_init__(self) -> None:
        if self.memory_bytes < GRANULE:
            raise ValueError(f"memory_bytes must be at least {GRANULE}, got {self.memory_bytes}")
        if self.ssd_capacity_bytes < 0 or self.gpu_memory_bytes < 0:
            raise ValueError("ssd_capacity_bytes and gpu_memory_bytes must not be negative")
        if not 0 < self.low_watermark <= self.high_watermark <= 1:
            raise ValueError(
                f"need 0 < low_watermark <= high_watermark <= 1, got "
                f"{self.low_watermark}, {self.high_watermark}"
            )


@dataclass(frozen=True, slots=True)
class Location:
    """A pinned block in the arena: read ``arena.buf[offset:offset+size]`` until unpinned."""

    offset: int
    size: int


@dataclass(frozen=True, slots=True)
class Reservation:
    """A slot to write ``key``'s bytes into (``arena.buf[offset:offset+size]``), then commit."""

    key: BlockKey
    offset: int
    size: int


class ReservationError(KVStoreError, ValueError):
    """commit/unpin of a key that is not reserved/pinned: a caller bug (or a connection that
    was already released). Nothing was changed by the call."""


class BlockStore:
    """One node's tiered block store. See the module docstring for the contract."""

    def __init__(self, config: StoreConfig) -> None:
        self.config = config
        self._host = HostIndex(config.memory_bytes, GRANULE)
        self._ssd = (SsdTier(config.ssd_path, config.ssd_capacity_bytes, config.on_corrupt_ssd)
                     if config.ssd_path else None)
        self._gpu = None
        self.index: SharedIndex | None = None
        arena: Arena | None = None
        try:
            if config.gpu_memory_bytes > 0:
                from kvstore.node.gpu_tier import GpuTier

                self._gpu = GpuTier(config.gpu_memory_bytes)
            arena = Arena.create(self._host.capacity, config.shm_name)
            if config.shared_index:
                self.index = self._host.shared = SharedIndex.create(arena.size)
        except BaseException:
            if self._ssd is not None:
                self._ssd.close()
            if arena is not None:
                arena.close()
            raise
        self.arena = arena
        self._lock = threading.Lock()
        self._closed = False
        self._s_host = TierStats(capacity_bytes=self._host.capacity)
        # Counters of every tier exist; those of a tier not configured are not reported.
        self._s_gpu = TierStats(capacity_bytes=self._gpu.capacity if self._gpu is not None else 0)
        self._s_ssd = TierStats(capacity_bytes=self._ssd.capacity if self._ssd is not None else 0)
        self._counters = StoreStats(host=self._s_host,
                                    gpu=self._s_gpu if self._gpu is not None else None,
                                    ssd=self._s_ssd if self._ssd is not None else None,
                                    ssd_moved_aside=int(self._ssd is not None
                                                        and self._ssd.moved_aside is not None))
        self._tiers = Tiering(self._host, self._gpu, self._ssd, self.arena, self._lock,
                              self._counters,
                              high_bytes=int(config.high_watermark * self._host.capacity),
                              low_bytes=int(config.low_watermark * self._host.capacity))
        # Same-host CUDA IPC readers and writers of the GPU tier (gpu_share.py); None without one.
        self.gpu_share = (GpuShare(self._gpu, self._lock, self._present_locked, self._ssd, self._s_gpu)
                          if self._gpu is not None else None)

    # -- writes -------------------------------------------------------------------------

    def reserve(self, items: Sequence[tuple[BlockKey, int]], owner: Hashable | None = None
                ) -> list[Reservation | None]:
        """Reserve arena slots for ``(key, size)`` items, all or nothing (see module doc)."""
        items = list(items)
        for key, size in items:
            if size <= 0:
                raise ValueError(f"block size must be positive, got {size} for {key!r}")
            if self._host.allocator.rounded(size) > self._host.capacity:
                raise StoreFull(f"a block of {size} bytes is larger than the host arena "
                                f"({self._host.capacity} bytes); raise --memory")
        out: list[Reservation | None] = [None] * len(items)
        with self._lock:
            self._check_open()
            made: list[HostEntry] = []
            seen: set[BlockKey] = set()
            for i in range(len(items) - 1, -1, -1):  # tail first, like every batch call
                key, size = items[i]
                if key in seen or self._present_locked(key):
                    self._counters.put_noops += 1
                    continue
                seen.add(key)
                entry = self._host.reserve(key, size, owner)
                while entry is None:
                    if not self._tiers.make_room_locked(size):
                        for e in made:
                            self._host.abort(e)
                        self._counters.store_full += 1
                        raise StoreFull(
                            f"cannot fit {sum(s for _, s in items)} bytes in {len(items)} blocks: "
                            f"{self._host.used_bytes} of {self._host.capacity} host bytes are pinned "
                            f"or being written; retry later, put fewer blocks at once or raise --memory"
                        )
                    entry = self._host.reserve(key, size, owner)
                made.append(entry)
                out[i] = Reservation(key, entry.offset, size)
        return out

    def commit(self, keys: Iterable[BlockKey]) -> None:
        """Make reserved blocks visible (checksummed outside the lock); may trigger demotion."""
        keys = list(keys)
        with self._lock:
            self._check_open()
            entries: list[HostEntry] = []
            for k in keys:
                e = self._host.get(k)
                if e is None or e.state is not EntryState.RESERVED:
                    raise ReservationError(f"commit of {k!r}, which is not reserved")
                entries.append(e)
        buf = self.arena.buf
        sums = [checksum(buf[e.offset : e.offset + e.size]) for e in entries]
        with self._lock:
            for e, c in zip(reversed(entries), reversed(sums)):
                if self._host.get(e.key) is e and e.state is EntryState.RESERVED:
                    self._host.commit(e, c)
                    self._counters.puts += 1
                    self._s_host.bytes_in += e.size
            pressure = self._tiers.over_high_locked()
        if pressure:
            self._tiers.relieve_pressure()

    def abort(self, keys: Iterable[BlockKey]) -> None:
        """Release reservations (keys not reserved are ignored: abort is cleanup)."""
        with self._lock:
            for k in keys:
                e = self._host.get(k)
                if e is not None and e.state is EntryState.RESERVED:
                    self._host.abort(e)

    def put(self, key: BlockKey, value: bytes | bytearray | memoryview) -> bool:
        """Store one block; False if it was already present (a successful no-op)."""
        mv = memoryview(value).cast("B")
        (res,) = self.reserve([(key, mv.nbytes)])
        if res is None:
            return False
        try:
            self.arena.buf[res.offset : res.offset + res.size] = mv
        except BaseException:
            self.abort([key])
            raise
        self.commit([key])
        return True

    def delete(self, keys: Iterable[BlockKey]) -> int:
        """Delete blocks from every tier; returns how many keys were present."""
        keys = list(dict.fromkeys(keys))
        with self._lock:
            self._check_open()
            found = {k for k in keys if self._host.delete(k)}
            if self._gpu is not None:
                found.update(k for k in keys if self._gpu.delete(k))
            if self._ssd is not None:
                on_ssd = [k for k in keys if k in self._ssd]
                found.update(on_ssd)
                self._ssd.delete(on_ssd)
        return len(found)

    # -- reads --------------------------------------------------------------------------

    def pin(self, keys: Sequence[BlockKey], owner: Hashable | None = None) -> list[Location | None]:
        """Pin blocks for reading; host locations, promoting GPU/SSD hits. None = miss."""
        keys = list(keys)
        out: list[Location | None] = [None] * len(keys)
        from_ssd: list[tuple[int, HostEntry, int]] = []  # (index in keys, slot, checksum)
        with self._lock:
            self._check_open()
            for i in range(len(keys) - 1, -1, -1):
                key = keys[i]
                e = self._host.get(key)
                if e is not None and e.visible:
                    self._host.pin(e, owner)
                    out[i] = Location(e.offset, e.size)
                    self._s_host.hits += 1
                    self._s_host.bytes_out += e.size
                    continue
                self._s_host.misses += 1
                if e is not None:  # being written, promoted or deleted: a miss
                    continue
                if self._gpu is not None:
                    slot = self._tiers.promote_from_gpu_locked(key, owner)
                    if slot is not None:
                        out[i] = Location(slot.offset, slot.size)
                        continue
                if self._ssd is None:
                    continue
                rec = self._ssd.record(key)
                if rec is None or (slot := self._tiers.reserve_slot_locked(key, rec.size)) is None:
                    self._s_ssd.misses += 1
                    continue
                from_ssd.append((i, slot, rec.checksum))
        if from_ssd:
            arrived = self._tiers.promote_from_ssd([(e, c) for _, e, c in from_ssd], owner)
            for (i, e, _), ok in zip(from_ssd, arrived):
                if ok:
                    out[i] = Location(e.offset, e.size)
        return out

    def unpin(self, keys: Iterable[BlockKey], owner: Hashable | None = None) -> None:
        """End reads of pinned blocks; they become the most recently used (head last)."""
        keys = list(keys)
        with self._lock:
            entries: list[HostEntry] = []
            for k in keys:
                e = self._host.get(k)
                if e is None or e.pins <= 0:
                    raise ReservationError(f"unpin of {k!r}, which is not pinned")
                entries.append(e)
            for e in reversed(entries):
                self._host.unpin(e, owner)

    def touch(self, keys: Sequence[BlockKey], counts: Sequence[int], sizes: Sequence[int]) -> int:
        """Reads served by the shared index, reported afterwards: ``counts[i]`` reads of
        ``sizes[i]`` bytes of ``keys[i]``, in the order used (the last is the most recent;
        a batch's reads arrive tail first, like every batch call's). Blocks still in the host
        tier become the most recently used; every read counts as a host hit. Returns the bytes
        read."""
        nbytes = 0
        with self._lock:
            self._check_open()
            for key, n, size in zip(keys, counts, sizes):
                e = self._host.get(key)
                if e is not None and e.visible:
                    self._host.touch(e)
                self._s_host.hits += n
                self._s_host.bytes_out += n * size
                nbytes += n * size
        return nbytes

    def get(self, key: BlockKey) -> bytes | None:
        """One block's bytes, or None."""
        (loc,) = self.pin([key])
        if loc is None:
            return None
        try:
            return bytes(self.arena.buf[loc.offset : loc.offset + loc.size])
        finally:
            self.unpin([key])

    def held_keys(self) -> list[BlockKey]:
        """Every stored key once, hottest first: host blocks being read, then the host LRU from
        its most recent end, then GPU, then SSD blocks by recency (for re-replication,
        ``kvstore.daemon.repair``). A snapshot; does not touch recency."""
        with self._lock:
            self._check_open()
            out = dict.fromkeys(self._host.pinned_keys())
            out.update(dict.fromkeys(reversed(self._host.lru_keys())))
            if self._gpu is not None:
                out.update(dict.fromkeys(reversed(self._gpu.lru_keys())))
        if self._ssd is not None:
            out.update(dict.fromkeys(reversed(self._ssd.lru_keys())))
        return list(out)

    def copy_out(self, key: BlockKey) -> bytes | None:
        """One block's bytes for copying it to another node: a host block as ``get`` reads it,
        an SSD-only one straight from SSD (verified; not promoted, so a re-replication pass
        does not flush the host tier), a GPU one through ``get``. None if absent."""
        with self._lock:
            self._check_open()
            e = self._host.get(key)
            on_ssd_only = (e is None and self._ssd is not None and key in self._ssd
                           and not (self._gpu is not None and key in self._gpu))
        if on_ssd_only:
            assert self._ssd is not None
            return self._ssd.get(key)
        return self.get(key)

    def contains(self, keys: Iterable[BlockKey]) -> list[bool]:
        """Which keys are stored in any tier. Does not touch recency."""
        with self._lock:
            return [self._visible_locked(k) for k in keys]

    def prefix_len(self, keys: Iterable[BlockKey]) -> int:
        """How many leading keys are stored. Does not touch recency."""
        n = 0
        with self._lock:
            for k in keys:
                if not self._visible_locked(k):
                    break
                n += 1
        return n

    # -- owners, stats, lifecycle ---------------------------------------------------------

    def release_owner(self, owner: Hashable) -> tuple[int, int]:
        """Abort ``owner``'s reservations and drop its pins; (reservations, pins) released."""
        with self._lock:
            reserved, pins = self._host.owner_state(owner)
            for e in reserved:
                self._host.abort(e)
            n_pins = 0
            for e, n in pins:
                for _ in range(n):
                    self._host.unpin(e, owner)
                n_pins += n
            if self._gpu is not None:  # its CUDA IPC pins and reservations (gpu_share.py)
                gpu_reserved, gpu_pins = self._gpu.release_owner(owner)
                return len(reserved) + gpu_reserved, n_pins + gpu_pins
        return len(reserved), n_pins

    def stats(self) -> StoreStats:
        """A snapshot of the counters, with occupancy filled in."""
        with self._lock:
            self._s_host.used_bytes = self._host.value_bytes
            self._s_host.allocated_bytes = self._host.used_bytes
            self._s_host.blocks = self._host.committed_blocks
            if self._gpu is not None:
                self._s_gpu.used_bytes = self._s_gpu.allocated_bytes = self._gpu.value_bytes
                self._s_gpu.blocks = len(self._gpu)
            if self._ssd is not None:
                self._s_ssd.used_bytes = self._s_ssd.allocated_bytes = self._ssd.used_bytes
                self._s_ssd.blocks = len(self._ssd)
                self._s_ssd.corrupt = self._ssd.corrupt
            return self._counters.copy()

    def close(self) -> None:
        """Close LMDB cleanly, free the GPU tier, unlink the arena. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._tiers.closed = True
        if self._ssd is not None:
            self._ssd.close()
        if self._gpu is not None:
            self._gpu.close()
        if self.index is not None:
            self.index.close()  # readers see "closed" before the arena goes
        self.arena.close()

    def __enter__(self) -> "BlockStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals: lookups ---------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise StoreUnavailable("this BlockStore is closed; open a new one")

    def _present_locked(self, key: BlockKey) -> bool:
        """Present in a tier or being written: a put of it is a no-op."""
        return (key in self._host or (self._gpu is not None and self._gpu.holds(key))
                or (self._ssd is not None and key in self._ssd))

    def _visible_locked(self, key: BlockKey) -> bool:
        e = self._host.get(key)
        if e is not None:
            return e.visible
        return (self._gpu is not None and key in self._gpu) or (self._ssd is not None and key in self._ssd)
