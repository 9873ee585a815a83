"""The optional GPU tier: blocks in one CUDA byte buffer of the daemon, LRU, below host.

Clients read and write the host arena (shared memory or sockets), so in the daemon this
tier is where host demotes to first when it exists: a GPU copy is far faster than an SSD
write. Its own LRU victims go on down to SSD (or are dropped without one). A get that hits
here copies the block back into the host arena and removes it from the GPU (the tiers
above SSD are exclusive; SSD keeps its copy on promotion, see ``store.py``).

Same-host CUDA IPC (``kvstore.node.gpu_share``, ``kvstore.node.cuda_ipc``): other processes
map the whole buffer and copy blocks device to device. For them a block can be *pinned*
(``pin``/``unpin``, per owner) and a slot *reserved*, written by the client, then committed
(``reserve``/``commit``/``abort``). A pinned or reserved block is never an LRU victim; a
pinned block that leaves the tier (promoted to host, deleted) keeps its space until its
last unpin, so a reader never sees its bytes reused. ``release_owner`` drops an owner's pins
and aborts its reservations. A block committed by a client has no checksum yet (None): it is
computed from its bytes when the block leaves the GPU.

torch is imported only when a ``GpuTier`` is built (``gpu_memory_bytes > 0``); kvstore does
not depend on it otherwise. Space comes from the same best-fit ``Allocator`` as the arena.
Copies are synchronous on the current stream. Not thread-safe: the store calls it under its
lock.
"""

from __future__ import annotations

import collections
from collections import OrderedDict
from collections.abc import Hashable, Iterable

import xxhash

from kvstore.keys import BlockKey
from kvstore.node.allocator import Allocator

__all__ = ["GpuTier", "GpuSlot", "DEFAULT_DEVICE"]

DEFAULT_DEVICE = "cuda"  # the store's tier lives here; tests run the same code on "cpu"


class GpuSlot:
    """One block's space in the buffer. Compared by identity: a key deleted while pinned and
    put again has two slots for a while."""

    __slots__ = ("key", "offset", "size", "checksum", "pins", "live")

    def __init__(self, key: BlockKey, offset: int, size: int, checksum: int | None) -> None:
        self.key, self.offset, self.size, self.checksum = key, offset, size, checksum
        self.pins = 0
        self.live = True  # False: left the tier while pinned; freed at its last unpin


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
        self._lru: OrderedDict[BlockKey, GpuSlot] = OrderedDict()  # committed, unpinned or not
        self._reserved: dict[BlockKey, tuple[GpuSlot, Hashable]] = {}  # being written by an owner
        self._owner_pins: dict[Hashable, dict[BlockKey, list[GpuSlot]]] = {}  # a slot once a pin
        self.value_bytes = 0

    @property
    def buffer(self):
        """The tier's whole byte buffer (a torch uint8 tensor): what CUDA IPC exports."""
        return self._buf

    @property
    def is_cuda(self) -> bool:
        return self._buf.device.type == "cuda"

    def __contains__(self, key: BlockKey) -> bool:
        return key in self._lru

    def holds(self, key: BlockKey) -> bool:
        """Committed here or reserved (being written): a put of it is a no-op."""
        return key in self._lru or key in self._reserved

    def __len__(self) -> int:
        return len(self._lru)

    def lru_keys(self) -> list[BlockKey]:
        return list(self._lru)

    # --- the store's tier: demotions in, promotions out ----------------------------------

    def put(self, key: BlockKey, checksum: int | None, data: memoryview | bytes
            ) -> list[tuple[BlockKey, int, bytes]]:
        """Store a block (most recently used); returns LRU victims ``(key, checksum, bytes)``
        that made room for it, for the caller to demote further. A block larger than the tier,
        or one with no room left beside pinned and reserved blocks, is not stored."""
        size = len(data)
        if self.holds(key) or size == 0 or size > self.capacity:
            return []
        victims: list[tuple[BlockKey, int, bytes]] = []
        offset = self._alloc(size, victims)
        if offset is None:
            return victims
        src = self._torch.frombuffer(data, dtype=self._torch.uint8)
        self._buf[offset : offset + size].copy_(src)
        self._lru[key] = GpuSlot(key, offset, size, checksum)
        self.value_bytes += size
        return victims

    def size_of(self, key: BlockKey) -> int | None:
        slot = self._lru.get(key)
        return None if slot is None else slot.size

    def take_into(self, key: BlockKey, dst: memoryview) -> int | None:
        """Move ``key`` out of the tier into ``dst``; its checksum, or None on a miss."""
        slot = self._lru.pop(key, None)
        if slot is None:
            return None
        view = self._torch.frombuffer(dst, dtype=self._torch.uint8)[: slot.size]
        view.copy_(self._buf[slot.offset : slot.offset + slot.size])
        checksum = slot.checksum if slot.checksum is not None else xxhash.xxh3_64_intdigest(
            dst[: slot.size])
        self._leave(slot)
        return checksum

    def delete(self, key: BlockKey) -> bool:
        slot = self._lru.pop(key, None)
        if slot is None:
            return False
        self._leave(slot)
        return True

    # --- same-host readers and writers (CUDA IPC) ----------------------------------------

    def pin(self, keys: Iterable[BlockKey], owner: Hashable) -> list[GpuSlot | None]:
        """Pin committed blocks for ``owner`` (the most recently used, tail first); None:
        not in this tier."""
        keys = list(keys)
        out: list[GpuSlot | None] = [None] * len(keys)
        pins = self._owner_pins.setdefault(owner, {})
        for i in range(len(keys) - 1, -1, -1):
            slot = self._lru.get(keys[i])
            if slot is not None:
                self._lru.move_to_end(slot.key)
                slot.pins += 1
                pins.setdefault(slot.key, []).append(slot)
                out[i] = slot
        return out

    def unpin(self, keys: Iterable[BlockKey], owner: Hashable) -> None:
        """End ``owner``'s reads of ``keys`` (KeyError, changing nothing, when it holds no
        such pin)."""
        pins = self._owner_pins.get(owner, {})
        need = collections.Counter(keys)
        for key, n in need.items():
            if len(pins.get(key, ())) < n:
                raise KeyError(key)
        for key, n in need.items():
            held = pins[key]
            held.sort(key=lambda s: s.live)  # a slot that left the tier first: free it soonest
            for slot in held[:n]:
                slot.pins -= 1
                self._free_if_done(slot)
            del held[:n]
            if not held:
                del pins[key]

    def reserve(self, items: list[tuple[BlockKey, int]], owner: Hashable
                ) -> tuple[list[GpuSlot | None] | None, list[tuple[BlockKey, int, bytes]]]:
        """Reserve slots for ``(key, size)`` items, all or nothing; None where a key is held
        already (nothing to write) or repeated. Returns (slots, LRU victims to demote);
        slots None when they do not fit beside the pinned and reserved blocks (nothing
        reserved; the victims taken meanwhile are still to demote)."""
        out: list[GpuSlot | None] = [None] * len(items)
        victims: list[tuple[BlockKey, int, bytes]] = []
        seen: set[BlockKey] = set()
        for i, (key, size) in enumerate(items):
            if key in seen or self.holds(key):
                continue
            seen.add(key)
            offset = self._alloc(size, victims) if 0 < size <= self.capacity else None
            if offset is None:
                for slot in out:
                    if slot is not None:
                        del self._reserved[slot.key]
                        self.allocator.free(slot.offset)
                return None, victims
            out[i] = slot = GpuSlot(key, offset, size, None)
            self._reserved[key] = (slot, owner)
        return out, victims

    def reserved_bytes(self, owner: Hashable) -> int:
        return sum(slot.size for slot, o in self._reserved.values() if o == owner)

    def reserved_by(self, keys: Iterable[BlockKey], owner: Hashable) -> bool:
        return all(self._reserved.get(k, (None, None))[1] == owner for k in keys)

    def commit(self, keys: Iterable[BlockKey], owner: Hashable) -> int:
        """Make ``owner``'s reserved blocks visible (most recently used); their bytes."""
        keys = list(keys)
        if not self.reserved_by(keys, owner):
            raise KeyError("not reserved by this owner")
        nbytes = 0
        for key in reversed(keys):
            rec = self._reserved.pop(key, None)
            if rec is None:  # repeated in keys
                continue
            slot = rec[0]
            self._lru[key] = slot
            self.value_bytes += slot.size
            nbytes += slot.size
        return nbytes

    def abort(self, keys: Iterable[BlockKey], owner: Hashable) -> None:
        for key in keys:
            rec = self._reserved.get(key)
            if rec is not None and rec[1] == owner:
                del self._reserved[key]
                self.allocator.free(rec[0].offset)

    def release_owner(self, owner: Hashable) -> tuple[int, int]:
        """Abort ``owner``'s reservations and drop its pins; (reservations, pins) released."""
        mine = [k for k, (_, o) in self._reserved.items() if o == owner]
        self.abort(mine, owner)
        n = 0
        for held in self._owner_pins.pop(owner, {}).values():
            for slot in held:
                slot.pins -= 1
                n += 1
                self._free_if_done(slot)
        return len(mine), n

    def close(self) -> None:
        """Free the device memory; the tier is then empty and holds nothing (capacity 0)."""
        self._lru.clear()
        self._reserved.clear()
        self._owner_pins.clear()
        self.value_bytes = 0
        self.capacity = 0  # put() stores nothing from now on
        self._buf = self._buf.new_empty(0)

    # --- internals -----------------------------------------------------------------------

    def _alloc(self, size: int, victims: list[tuple[BlockKey, int, bytes]]) -> int | None:
        """An offset for ``size`` bytes, evicting unpinned LRU blocks into ``victims``;
        None when no evictable block is left."""
        offset = self.allocator.alloc(size)
        while offset is None:
            victim = next((s for s in self._lru.values() if s.pins == 0), None)
            if victim is None:
                return None
            del self._lru[victim.key]
            data = self._read(victim.offset, victim.size)
            c = victim.checksum if victim.checksum is not None else xxhash.xxh3_64_intdigest(data)
            victims.append((victim.key, c, data))
            self.allocator.free(victim.offset)
            self.value_bytes -= victim.size
            offset = self.allocator.alloc(size)
        return offset

    def _leave(self, slot: GpuSlot) -> None:
        """``slot`` is out of the LRU: free it now, or at its last unpin."""
        self.value_bytes -= slot.size
        slot.live = False
        self._free_if_done(slot)

    def _free_if_done(self, slot: GpuSlot) -> None:
        if not slot.live and slot.pins == 0 and self.capacity:
            slot.pins = -1  # freed: never twice
            self.allocator.free(slot.offset)

    def _read(self, offset: int, size: int) -> bytes:
        return self._buf[offset : offset + size].cpu().numpy().tobytes()
