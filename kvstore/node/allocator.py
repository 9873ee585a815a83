"""Space allocator of the host arena: granule-rounded extents, best fit, immediate coalescing.

Contract: ``alloc(nbytes)`` returns a byte offset aligned to ``granule`` (>= 64, a power of
two) or ``None`` when no free extent is large enough; ``free(offset)`` returns the extent and
merges it with free neighbours at once. Nothing else is kept per block, so a block costs
two dict entries.

Why this design and not size-class slabs. KV blocks come in a few fixed sizes per model
(e.g. 360 KiB and 720 KiB, one 16-token block in bf16 and float32, plus a 64-byte codec
header), but the sizes are not known up front and rare large values (16 MiB) must fit too.
Slabs carved per size class pin memory to a class: after churn a class that no longer gets
requests holds half-empty spans that the other class cannot use, and freeing a span needs
the eviction policy to empty it, which LRU does not do. Here memory never belongs to a
class. Each free extent is indexed by its exact length (a bin per distinct length, and a
sorted list of the lengths present), so with a few block sizes best fit is an exact-size
hit: a freed 360 KiB block is reused by the next 360 KiB block, two adjacent freed ones
merge into room for a 720 KiB block, and the remainder of a split stays one extent. Holes
left between live blocks are always of some block size (or a sum of them), so they are
reused instead of turning into slivers. ``tests/kvstore/test_arena.py`` measures it: with
360/720 KiB blocks in random order the arena is >= 90% full of block bytes whenever an
allocation fails, both on first fill and after thousands of LRU evict/allocate cycles.

Costs: ``alloc`` and ``free`` are O(log k) for k distinct free lengths (a bisect, and a list
insert when a new length appears), a handful of dict operations otherwise. Not thread-safe:
the store calls it under its lock.
"""

from __future__ import annotations

from bisect import bisect_left, insort

__all__ = ["Allocator"]


class Allocator:
    """Best-fit extent allocator over ``[0, capacity)`` in units of ``granule`` bytes."""

    def __init__(self, capacity: int, granule: int = 4096) -> None:
        if granule < 64 or granule & (granule - 1):
            raise ValueError(f"granule must be a power of two >= 64, got {granule}")
        if capacity < granule:
            raise ValueError(f"capacity {capacity} is smaller than one granule ({granule})")
        self.granule = granule
        self._shift = granule.bit_length() - 1
        self.units = capacity >> self._shift
        self.capacity = self.units << self._shift
        self._free_at: dict[int, int] = {}  # start unit -> length of a free extent
        self._free_end: dict[int, int] = {}  # end unit (exclusive) -> start unit
        self._bins: dict[int, set[int]] = {}  # length -> starts of free extents of that length
        self._lengths: list[int] = []  # sorted lengths that have a non-empty bin
        self._used: dict[int, int] = {}  # start unit -> length of an allocated extent
        self.used_bytes = 0
        self._add_free(0, self.units)

    # -- public -------------------------------------------------------------------------

    def rounded(self, nbytes: int) -> int:
        """Bytes an allocation of ``nbytes`` takes (rounded up to the granule)."""
        return self._units(nbytes) << self._shift

    def alloc(self, nbytes: int) -> int | None:
        """Offset of a new extent of at least ``nbytes``, or ``None`` if none is free."""
        if nbytes <= 0:
            raise ValueError(f"allocation size must be positive, got {nbytes}")
        n = self._units(nbytes)
        i = bisect_left(self._lengths, n)
        if i == len(self._lengths):
            return None
        length = self._lengths[i]
        start = self._bins[length].pop()
        self._drop_free(start, length, already_unbinned=True)
        if length > n:
            self._add_free(start + n, length - n)
        self._used[start] = n
        self.used_bytes += n << self._shift
        return start << self._shift

    def free(self, offset: int) -> None:
        """Return the extent at ``offset`` (from ``alloc``) and merge it with free neighbours."""
        start = offset >> self._shift
        n = self._used.pop(start, None)
        if n is None or start << self._shift != offset:
            raise ValueError(f"offset {offset} is not an allocated extent")
        self.used_bytes -= n << self._shift
        end = start + n
        prev_start = self._free_end.get(start)
        if prev_start is not None:
            self._drop_free(prev_start, start - prev_start)
            start = prev_start
        next_len = self._free_at.get(end)
        if next_len is not None:
            self._drop_free(end, next_len)
            end += next_len
        self._add_free(start, end - start)

    @property
    def largest_free(self) -> int:
        """Bytes of the largest free extent (0 when full)."""
        return self._lengths[-1] << self._shift if self._lengths else 0

    @property
    def allocations(self) -> int:
        return len(self._used)

    # -- internals ----------------------------------------------------------------------

    def _units(self, nbytes: int) -> int:
        return (nbytes + self.granule - 1) >> self._shift

    def _add_free(self, start: int, length: int) -> None:
        self._free_at[start] = length
        self._free_end[start + length] = start
        bin_ = self._bins.get(length)
        if bin_ is None:
            self._bins[length] = {start}
            insort(self._lengths, length)
        else:
            bin_.add(start)

    def _drop_free(self, start: int, length: int, already_unbinned: bool = False) -> None:
        del self._free_at[start]
        del self._free_end[start + length]
        bin_ = self._bins[length]
        if not already_unbinned:
            bin_.remove(start)
        if not bin_:
            del self._bins[length]
            del self._lengths[bisect_left(self._lengths, length)]
