"""BlockManager on tiny specs: exact block ids, exact eviction order, exact events."""

from __future__ import annotations

import pytest

from engine.core.block_manager import BlockManager, KVEvent
from kvstore.keys import block_keys, namespace_id

NS = namespace_id({"test": "block_manager"})
BS = 2


def keys_of(tokens: list[int]):
    return block_keys(NS, tokens, BS)


@pytest.fixture
def events() -> list[KVEvent]:
    return []


@pytest.fixture
def bm(events: list[KVEvent]) -> BlockManager:
    return BlockManager(4, BS, on_event=events.append)


def test_fresh_blocks_come_in_ascending_order_and_uncached_reuse_is_lifo(bm: BlockManager) -> None:
    assert bm.allocate(3) == [0, 1, 2]
    assert bm.num_free_blocks == 1
    bm.free([0, 1, 2])  # freed tail first: 2, 1, 0 pushed, so 0 comes back first
    assert bm.num_free_blocks == 4
    assert bm.allocate(2) == [0, 1]
    assert bm.allocate(2) == [2, 3]
    assert bm.allocate(1) is None


def test_allocate_is_all_or_nothing(bm: BlockManager, events: list[KVEvent]) -> None:
    assert bm.allocate(2) == [0, 1]
    assert bm.allocate(3) is None
    assert bm.num_free_blocks == 2
    assert [bm.ref_count(b) for b in range(4)] == [1, 1, 0, 0]
    assert events == []


def test_cache_lookup_and_eviction_tail_first(bm: BlockManager, events: list[KVEvent]) -> None:
    keys = keys_of(list(range(8)))  # 4 full blocks
    table = bm.allocate(4)
    assert table == [0, 1, 2, 3]
    bm.cache(table, keys)
    assert events == [KVEvent("stored", tuple(keys))]
    assert bm.lookup(keys) == [0, 1, 2, 3]
    assert bm.lookup(keys, max_blocks=3) == [0, 1, 2]
    assert bm.lookup(keys_of([9, 9] + list(range(2, 8)))) == []  # a different head: no hit

    bm.free(table)  # cached blocks stay hittable; LRU order is 3, 2, 1, 0 (tail first)
    assert bm.num_free_blocks == 4
    assert bm.lookup(keys) == [0, 1, 2, 3]
    assert bm.allocate(1) == [3]
    assert events[-1] == KVEvent("removed", (keys[3],))
    assert bm.lookup(keys) == [0, 1, 2]
    assert bm.allocate(2) == [2, 1]
    assert events[-1] == KVEvent("removed", (keys[2], keys[1]))
    assert bm.lookup(keys) == [0]
    assert bm.key_of(1) is None and bm.key_of(0) == keys[0]
    assert set(bm.cached_keys()) == {keys[0]}


def test_uncached_free_blocks_are_used_before_evicting_cached_ones(
    bm: BlockManager, events: list[KVEvent]
) -> None:
    keys = keys_of([1, 2, 3, 4])
    table = bm.allocate(2)
    bm.cache(table, keys)
    bm.free(table)
    assert bm.allocate(2) == [2, 3]  # no eviction
    assert [e.type for e in events] == ["stored"]
    assert bm.lookup(keys) == [0, 1]


def test_hit_takes_a_free_cached_block_out_of_the_free_queue(
    bm: BlockManager, events: list[KVEvent]
) -> None:
    keys = keys_of([1, 2, 3, 4, 5, 6])
    a = bm.allocate(3)
    bm.cache(a, keys)
    bm.free(a)  # LRU: 2, 1, 0; uncached: 3
    hits = bm.lookup(keys, max_blocks=2)
    assert hits == [0, 1]
    # 2 hits (both free) + 2 fresh need 4 of the 4 free blocks: 3 (uncached), then evict 2.
    b = bm.allocate(2, hits)
    assert b == [0, 1, 3, 2]
    assert events[-1] == KVEvent("removed", (keys[2],))
    assert bm.num_free_blocks == 0
    assert bm.allocate(0, [0]) == [0]  # a hit on a held block needs no free block
    assert bm.ref_count(0) == 2
    bm.free([0])
    assert bm.ref_count(0) == 1 and bm.num_free_blocks == 0


def test_hits_count_against_free_blocks_when_they_are_free(bm: BlockManager) -> None:
    keys = keys_of([1, 2, 3, 4])
    a = bm.allocate(2)
    bm.cache(a, keys)
    bm.free(a)
    assert bm.allocate(3, [0, 1]) is None  # 2 free hits + 3 fresh > 4
    assert bm.num_free_blocks == 4 and bm.ref_count(0) == 0
    assert bm.allocate(2, [0, 1]) == [0, 1, 2, 3]


def test_a_key_maps_to_one_block_first_one_wins(bm: BlockManager, events: list[KVEvent]) -> None:
    keys = keys_of([1, 2])
    a, b = bm.allocate(1), bm.allocate(1)
    bm.cache(a, keys)
    bm.cache(b, keys)  # the same prefix computed twice at once
    assert events == [KVEvent("stored", (keys[0],))]
    assert bm.key_of(b[0]) is None
    bm.cache(a, keys)  # idempotent
    assert len(events) == 1
    bm.free(b)
    assert bm.allocate(1) == b  # the duplicate went back uncached


def test_prefix_caching_disabled_never_hits_nor_emits() -> None:
    events: list[KVEvent] = []
    bm = BlockManager(2, BS, enable_prefix_caching=False, on_event=events.append)
    keys = keys_of([1, 2, 3, 4])
    table = bm.allocate(2)
    bm.cache(table, keys)
    assert bm.lookup(keys) == [] and events == [] and bm.cached_keys() == []


def test_num_blocks_needed() -> None:
    bm = BlockManager(8, 4)
    assert bm.num_blocks_needed(0, 0) == 0
    assert bm.num_blocks_needed(1, 0) == 1
    assert bm.num_blocks_needed(4, 1) == 0
    assert bm.num_blocks_needed(5, 1) == 1
    assert bm.num_blocks_needed(9, 1) == 2


def test_bad_sizes_are_rejected() -> None:
    with pytest.raises(ValueError, match="positive"):
        BlockManager(0, 16)


def test_can_allocate_agrees_with_allocate_and_changes_nothing(bm: BlockManager) -> None:
    keys = keys_of([1, 2, 3, 4])
    a = bm.allocate(2)
    assert a is not None
    bm.cache(a, keys)
    bm.free(a)  # both cached and free: taking them as hits uses up free blocks
    hits = bm.lookup(keys)
    assert hits == a
    assert bm.can_allocate(2, hits) and not bm.can_allocate(3, hits)
    assert bm.num_free_blocks == 4 and bm.lookup(keys) == a
    assert bm.allocate(3, hits) is None and bm.allocate(2, hits) is not None
