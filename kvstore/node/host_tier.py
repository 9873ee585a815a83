"""The host tier's index: key -> entry (location, size, checksum, pins, last use) with exact LRU.

Policy lives in ``store.py``; this module keeps the bookkeeping exact and O(1) per block:

- An entry is ``RESERVED`` (space allocated, a writer is filling it) or ``COMMITTED``.
- The LRU is an ``OrderedDict`` of exactly the evictable entries: committed and unpinned.
  Pinning takes an entry out of it, the last unpin puts it back at the most-recent end, so
  eviction is ``popitem(last=False)`` and never has to skip a pinned block. Reserved entries
  are never in it. "Last use" is therefore the later of commit and last unpin.
- Batch callers touch keys from last to first (``docs/decisions/0005-eviction-tail-before-head.md``):
  the store does that; this index only records the order it is given.
- Pins and reservations are counted per ``owner`` (any hashable token, e.g. a connection) so
  ``release_owner`` can drop everything a dead connection held. ``owner=None`` is not tracked.
- A delete of a pinned entry marks it ``doomed``: lookups no longer see it, and its space is
  freed at the last unpin.
- With a ``SharedIndex`` (``shared``, ``kvstore.node.shared_index``) every visible entry is
  published there once committed and retracted the moment it stops being visible (delete)
  or before its space is freed (eviction, demotion), so a client reading it without asking
  the daemon never sees space that was handed out again. ``touch`` is a read reported
  afterwards: the entry becomes the most recently used, as at an unpin.

Not thread-safe: every call is made under the store's lock.
"""

from __future__ import annotations

import enum
from collections import Counter, OrderedDict
from collections.abc import Hashable, Iterator

from kvstore.keys import BlockKey
from kvstore.node.allocator import Allocator
from kvstore.node.shared_index import SharedIndex

__all__ = ["EntryState", "HostEntry", "HostIndex"]


class EntryState(enum.Enum):
    RESERVED = 1
    COMMITTED = 2


class HostEntry:
    """One block in the arena. ``on_ssd``: a copy also lives on SSD (demotion needs no write)."""

    __slots__ = ("key", "offset", "size", "state", "checksum", "pins", "owner", "doomed", "on_ssd")

    def __init__(self, key: BlockKey, offset: int, size: int, owner: Hashable | None) -> None:
        self.key = key
        self.offset = offset
        self.size = size
        self.state = EntryState.RESERVED
        self.checksum = 0
        self.pins = 0
        self.owner = owner
        self.doomed = False
        self.on_ssd = False

    @property
    def visible(self) -> bool:
        """A committed, not deleted block: what lookups and pins see."""
        return self.state is EntryState.COMMITTED and not self.doomed

    def __repr__(self) -> str:
        return (
            f"HostEntry({self.key!r}, off={self.offset}, size={self.size}, {self.state.name}, "
            f"pins={self.pins}{', doomed' if self.doomed else ''})"
        )


class HostIndex:
    """Entries of the host arena, their allocator, LRU and per-owner pins/reservations."""

    def __init__(self, capacity: int, granule: int = 64, shared: SharedIndex | None = None) -> None:
        self.allocator = Allocator(capacity, granule)
        self.shared = shared  # set by the store once the index exists (before any entry)
        self._entries: dict[BlockKey, HostEntry] = {}
        self._lru: OrderedDict[BlockKey, HostEntry] = OrderedDict()
        self._owner_pins: dict[Hashable, Counter[BlockKey]] = {}
        self._owner_reserved: dict[Hashable, set[BlockKey]] = {}
        self.value_bytes = 0  # bytes of committed blocks (unrounded)
        self._committed = 0

    # -- lookups (never touch recency) --------------------------------------------------

    def get(self, key: BlockKey) -> HostEntry | None:
        return self._entries.get(key)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: BlockKey) -> bool:
        """Any entry, reserved or doomed included."""
        return key in self._entries

    @property
    def capacity(self) -> int:
        return self.allocator.capacity

    @property
    def used_bytes(self) -> int:
        """Allocated bytes (committed and reserved, rounded to the granule)."""
        return self.allocator.used_bytes

    @property
    def committed_blocks(self) -> int:
        """Committed blocks still holding space (a doomed, pinned one counts until freed)."""
        return self._committed

    def lru_keys(self) -> list[BlockKey]:
        """Evictable keys, least recently used first (for tests and debugging)."""
        return list(self._lru)

    def pinned_keys(self) -> list[BlockKey]:
        """Committed, visible keys that are pinned now (not in the LRU: being read)."""
        return [k for k, e in self._entries.items() if e.visible and e.pins > 0]

    def evictable(self) -> int:
        return len(self._lru)

    # -- writes -------------------------------------------------------------------------

    def reserve(self, key: BlockKey, size: int, owner: Hashable | None) -> HostEntry | None:
        """A new RESERVED entry for ``key`` (must be absent), or ``None`` if no space is free."""
        assert key not in self._entries, key
        offset = self.allocator.alloc(size)
        if offset is None:
            return None
        entry = HostEntry(key, offset, size, owner)
        self._entries[key] = entry
        if owner is not None:
            self._owner_reserved.setdefault(owner, set()).add(key)
        return entry

    def commit(self, entry: HostEntry, checksum: int, pin_owner: Hashable | None = None,
               pinned: bool = False) -> None:
        """Make a reservation visible; most recently used, or pinned by ``pin_owner``."""
        assert entry.state is EntryState.RESERVED
        self._forget_reservation(entry)
        entry.state = EntryState.COMMITTED
        entry.checksum = checksum
        self.value_bytes += entry.size
        self._committed += 1
        if pinned:
            self.pin(entry, pin_owner)
        else:
            self._lru[entry.key] = entry
        if self.shared is not None:
            self.shared.publish(entry.key, entry.offset, entry.size)

    def abort(self, entry: HostEntry) -> None:
        assert entry.state is EntryState.RESERVED
        self._forget_reservation(entry)
        self._free(entry)

    def pin(self, entry: HostEntry, owner: Hashable | None) -> None:
        entry.pins += 1
        if entry.pins == 1:
            self._lru.pop(entry.key, None)
        if owner is not None:
            self._owner_pins.setdefault(owner, Counter())[entry.key] += 1

    def unpin(self, entry: HostEntry, owner: Hashable | None) -> None:
        """Drop one pin; the last one makes the entry most recently used (or frees it if doomed)."""
        if entry.pins <= 0:
            raise ValueError(f"{entry.key!r} is not pinned")
        if owner is not None:
            counts = self._owner_pins.get(owner)
            if counts is None or counts[entry.key] <= 0:
                raise ValueError(f"{entry.key!r} is not pinned by this owner")
            counts[entry.key] -= 1
            if not counts[entry.key]:
                del counts[entry.key]
                if not counts:
                    del self._owner_pins[owner]
        entry.pins -= 1
        if entry.pins == 0:
            if entry.doomed:
                self._free(entry)
            else:
                self._lru[entry.key] = entry

    def touch(self, entry: HostEntry) -> None:
        """A read the index served (no pin): an unpinned entry becomes the most recently used."""
        if entry.key in self._lru:
            self._lru.move_to_end(entry.key)

    def release_and_free(self, entry: HostEntry) -> bool:
        """Drop an owner-less pin (the store's own, e.g. during demotion). If it was the last
        pin, free the entry instead of returning it to the LRU; True if freed."""
        assert entry.pins > 0
        entry.pins -= 1
        if entry.pins == 0:
            self._free(entry)
            return True
        return False

    def pop_lru(self) -> HostEntry | None:
        """Take the least recently used evictable entry out of the LRU (caller frees or pins it)."""
        if not self._lru:
            return None
        return self._lru.popitem(last=False)[1]

    def remove(self, entry: HostEntry) -> None:
        """Free a committed entry that is out of the LRU (popped) and unpinned."""
        assert entry.pins == 0 and entry.key not in self._lru
        self._free(entry)

    def delete(self, key: BlockKey) -> bool:
        """Delete a visible block now, or when its last pin goes. False if not visible."""
        entry = self._entries.get(key)
        if entry is None or not entry.visible:
            return False
        if self.shared is not None:
            self.shared.retract(key)  # hidden at once, from readers of the index too
        if entry.pins:
            entry.doomed = True
        else:
            del self._lru[key]
            self._free(entry)
        return True

    # -- owners -------------------------------------------------------------------------

    def owner_state(self, owner: Hashable) -> tuple[list[HostEntry], list[tuple[HostEntry, int]]]:
        """(reservations, (entry, pin count) pairs) held by ``owner``."""
        reserved = [self._entries[k] for k in self._owner_reserved.get(owner, ())]
        pins = [(self._entries[k], n) for k, n in self._owner_pins.get(owner, Counter()).items()]
        return reserved, pins

    def owners(self) -> Iterator[Hashable]:
        return iter(set(self._owner_pins) | set(self._owner_reserved))

    # -- internals ----------------------------------------------------------------------

    def _forget_reservation(self, entry: HostEntry) -> None:
        if entry.owner is not None:
            keys = self._owner_reserved.get(entry.owner)
            if keys is not None:
                keys.discard(entry.key)
                if not keys:
                    del self._owner_reserved[entry.owner]
        entry.owner = None

    def _free(self, entry: HostEntry) -> None:
        if entry.state is EntryState.COMMITTED:
            if self.shared is not None:
                self.shared.retract(entry.key)  # before the space can be handed out again
            self.value_bytes -= entry.size
            self._committed -= 1
        del self._entries[entry.key]
        self.allocator.free(entry.offset)
