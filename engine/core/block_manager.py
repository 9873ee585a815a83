"""BlockManager: the pool of physical KV blocks, with prefix caching under kvstore keys.

Model. ``num_blocks`` blocks, each with a reference count and, once full and computed, the
:class:`BlockKey` of the prefix it ends (its *cached* state). A key maps to at most one block.

Free blocks live in two queues:

- *uncached* free blocks (never filled, or partial when freed): a LIFO stack. They hold nothing
  worth keeping, so they are reused first, most recently freed first (warm in caches).
- *cached* free blocks: an LRU queue. A freed cached block keeps its key and can be hit again
  (which takes it out of the queue) until it is evicted for reuse, least recently freed first.
  Tables are freed tail first, so within one request the tail is evicted before the head.
  ``OrderedDict`` gives O(1) removal from the middle (a hit on a free block).

Events. When a block gets its key it emits ``KVEvent("stored", keys)``; when a cached block is
evicted (its key dropped for reuse) it emits ``KVEvent("removed", keys)``; one event per call,
keys in order. The worker server publishes them; here they are a plain callback.

Contract with the scheduler: the manager owns blocks, the scheduler owns requests. The manager
never touches a :class:`Request`; it takes and returns block ids, and the scheduler writes
block tables. ``lookup`` is side-effect free; ``allocate`` is all-or-nothing and returns None
when the blocks do not fit (an expected outcome: the caller preempts or waits).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from kvstore.keys import BlockKey

__all__ = ["KVEvent", "BlockManager"]


@dataclass(frozen=True)
class KVEvent:
    """Blocks that entered (``stored``) or left (``removed``) the device prefix cache."""

    type: Literal["stored", "removed"]
    keys: tuple[BlockKey, ...] = field(default=())


class BlockManager:
    """Reference-counted blocks with an LRU prefix cache. See the module docstring."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = True,
        on_event: Callable[[KVEvent], None] | None = None,
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.on_event = on_event
        self._ref = [0] * num_blocks
        self._key: list[BlockKey | None] = [None] * num_blocks
        self._cached: dict[BlockKey, int] = {}
        self._free_uncached: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() -> 0, 1, ...
        self._free_cached: OrderedDict[int, None] = OrderedDict()

    # -- reads ----------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks allocatable now (uncached free + evictable cached)."""
        return len(self._free_uncached) + len(self._free_cached)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    def key_of(self, block_id: int) -> BlockKey | None:
        return self._key[block_id]

    def cached_keys(self) -> list[BlockKey]:
        """Every key in the device cache (for a snapshot of the event stream)."""
        return list(self._cached)

    def lookup(self, keys: Sequence[BlockKey], max_blocks: int | None = None) -> list[int]:
        """Blocks of the longest cached prefix of ``keys`` (at most ``max_blocks``). No side effects.

        The caller caps ``max_blocks`` so the last token of a prompt is always computed
        (``(num_tokens - 1) // block_size``).
        """
        if not self.enable_prefix_caching:
            return []
        limit = len(keys) if max_blocks is None else min(max_blocks, len(keys))
        hits: list[int] = []
        for key in keys[:limit]:
            block_id = self._cached.get(key)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def num_blocks_needed(self, num_tokens: int, num_held: int) -> int:
        """New blocks a table of ``num_held`` blocks needs to cover ``num_tokens`` tokens."""
        return max(0, -(-num_tokens // self.block_size) - num_held)

    def can_allocate(self, num_new: int, hits: Sequence[int] = ()) -> bool:
        """Whether :meth:`allocate` of the same arguments would succeed now. No side effects."""
        free_hits = sum(1 for b in hits if self._ref[b] == 0)
        return num_new + free_hits <= self.num_free_blocks

    # -- writes ---------------------------------------------------------------------------

    def allocate(self, num_new: int, hits: Sequence[int] = ()) -> list[int] | None:
        """Take the hit blocks and ``num_new`` fresh ones; ``hits + fresh`` or None if no fit.

        All-or-nothing: on None nothing changed. Hits that sit in the free queue count against
        the free blocks (taking them makes them unavailable for reuse).
        """
        if not self.can_allocate(num_new, hits):
            return None
        for b in hits:
            if self._ref[b] == 0:
                del self._free_cached[b]
            self._ref[b] += 1
        fresh: list[int] = []
        evicted: list[BlockKey] = []
        for _ in range(num_new):
            if self._free_uncached:
                b = self._free_uncached.pop()
            else:
                b, _ = self._free_cached.popitem(last=False)
                key = self._key[b]
                assert key is not None and self._cached.get(key) == b
                del self._cached[key]
                self._key[b] = None
                evicted.append(key)
            self._ref[b] = 1
            fresh.append(b)
        if evicted:
            self._emit(KVEvent("removed", tuple(evicted)))
        return [*hits, *fresh]

    def cache(self, block_ids: Iterable[int], keys: Iterable[BlockKey]) -> None:
        """Mark full, computed blocks as cached under their keys (``stored`` event).

        A block already cached keeps its key; a key already held by another block leaves this
        block uncached (two requests computed the same prefix at once; the first one wins).
        """
        if not self.enable_prefix_caching:
            return
        stored: list[BlockKey] = []
        for b, key in zip(block_ids, keys, strict=True):
            assert self._ref[b] > 0, f"block {b} cached while free"
            if self._key[b] is not None:
                assert self._key[b] == key, f"block {b} re-keyed"
                continue
            if key in self._cached:
                continue
            self._key[b] = key
            self._cached[key] = b
            stored.append(key)
        if stored:
            self._emit(KVEvent("stored", tuple(stored)))

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference to each block, tail first; unreferenced blocks become free."""
        for b in reversed(block_ids):
            assert self._ref[b] > 0, f"block {b} freed twice"
            self._ref[b] -= 1
            if self._ref[b] == 0:
                if self._key[b] is not None:
                    self._free_cached[b] = None
                else:
                    self._free_uncached.append(b)

    def _emit(self, event: KVEvent) -> None:
        if self.on_event is not None:
            self.on_event(event)
