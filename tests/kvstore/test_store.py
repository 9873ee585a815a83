"""BlockStore: semantics, exact LRU order, watermarks, demotion/promotion, persistence."""

from __future__ import annotations

import threading

import pytest

from kvstore.errors import StoreFull
from kvstore.keys import BlockKey
from kvstore.node.store import BlockStore, ReservationError, StoreConfig

B = 4096  # block size in these tests (a multiple of the 64-byte granule: exact accounting)


def K(i: int) -> BlockKey:
    return BlockKey(i.to_bytes(16, "little"))


def V(i: int, size: int = B) -> bytes:
    return (i.to_bytes(16, "little") * (size // 16 + 1))[:size]


def put_batch(store: BlockStore, ids, owner=None):
    res = store.reserve([(K(i), B) for i in ids], owner=owner)
    for i, r in zip(ids, res):
        if r is not None:
            store.arena.buf[r.offset : r.offset + r.size] = V(i)
    store.commit([K(i) for i, r in zip(ids, res) if r is not None])
    return res


@pytest.fixture
def mem_store():
    """Room for exactly 8 blocks, no SSD, watermarks off: eviction only when a reserve needs it."""
    s = BlockStore(StoreConfig(memory_bytes=8 * B, high_watermark=1.0, low_watermark=1.0))
    yield s
    s.close()


@pytest.fixture
def ssd_store(tmp_path):
    """20 blocks of host; demote past 10 blocks down to 5; SSD holds 30 blocks."""
    cfg = StoreConfig(memory_bytes=20 * B, ssd_path=str(tmp_path / "ssd"), ssd_capacity_bytes=30 * B,
                      high_watermark=0.5, low_watermark=0.25)
    s = BlockStore(cfg)
    yield s, cfg
    s.close()


def test_put_get_and_put_of_a_present_key_is_a_noop(mem_store):
    assert mem_store.put(K(1), V(1))
    assert not mem_store.put(K(1), b"other bytes")
    assert mem_store.get(K(1)) == V(1)
    assert mem_store.get(K(2)) is None
    res = mem_store.reserve([(K(3), B), (K(3), B), (K(1), B)])
    assert res[1] is not None and res[0] is None and res[2] is None  # dup in batch: reserved once
    assert mem_store.reserve([(K(3), B)]) == [None]  # being written
    mem_store.abort([K(3)])
    st = mem_store.stats()
    assert st.puts == 1 and st.put_noops == 4
    assert st.host.blocks == 1 and st.host.used_bytes == B


def test_exact_lru_order_with_tail_before_head(mem_store):
    put_batch(mem_store, [0, 1, 2, 3])  # a prefix: its tail 3 is the least recent
    put_batch(mem_store, [10, 11, 12, 13])
    assert mem_store._host.lru_keys() == [K(i) for i in (3, 2, 1, 0, 13, 12, 11, 10)]
    assert mem_store.contains([K(3), K(13)]) == [True, True]
    assert mem_store.prefix_len([K(0), K(1), K(2), K(3), K(99)]) == 4  # lookups: no touch
    locs = mem_store.pin([K(0), K(1)])
    mem_store.unpin([K(0), K(1)])  # read: 1 then 0 become the most recent
    assert all(locs)
    put_batch(mem_store, [20, 21, 22])
    assert mem_store.contains([K(i) for i in (3, 2, 13)]) == [False] * 3
    assert mem_store._host.lru_keys() == [K(i) for i in (12, 11, 10, 1, 0, 22, 21, 20)]
    assert mem_store.stats().host.evictions == 3


def test_pinned_and_reserved_blocks_are_never_evicted(mem_store):
    put_batch(mem_store, range(8))
    mem_store.pin([K(0), K(1)], owner="reader")
    held = mem_store.reserve([(K(50), B)], owner="writer")  # evicts 7, the tail
    assert held[0] is not None and not mem_store.contains([K(7)])[0]
    put_batch(mem_store, range(100, 105))  # evicts 6..2: only unpinned ones
    assert mem_store.contains([K(0), K(1)]) == [True, True]
    used = mem_store.stats().host.allocated_bytes
    with pytest.raises(StoreFull):
        mem_store.reserve([(K(200), B), (K(201), B), (K(202), B), (K(203), B), (K(204), B),
                           (K(205), B), (K(206), B)])  # 5 evictable + 3 held < 7 + 3
    st = mem_store.stats()
    assert st.store_full == 1 and st.host.allocated_bytes <= used
    assert mem_store.contains([K(200 + i) for i in range(7)]) == [False] * 7
    assert mem_store.reserve([(K(200), B)]) != [None]  # none of them was left reserved
    assert mem_store.release_owner("reader") == (0, 2)
    assert mem_store.release_owner("writer") == (1, 0)
    assert not mem_store.contains([K(50)])[0]


def test_store_full_when_everything_is_pinned_leaves_nothing_behind(mem_store):
    put_batch(mem_store, range(8))
    mem_store.pin([K(i) for i in range(8)])
    with pytest.raises(StoreFull):
        mem_store.reserve([(K(9), B)])
    with pytest.raises(StoreFull):
        mem_store.reserve([(K(10), 9 * B)])  # larger than the arena
    assert mem_store.stats().host.allocated_bytes == 8 * B
    mem_store.unpin([K(i) for i in range(8)])
    assert mem_store.put(K(9), V(9))


def test_abort_releases_space_and_commit_checks_reservation(mem_store):
    mem_store.reserve([(K(1), B), (K(2), B)])
    assert mem_store.stats().host.allocated_bytes == 2 * B
    mem_store.abort([K(1), K(2)])
    assert mem_store.stats().host.allocated_bytes == 0
    with pytest.raises(ReservationError):
        mem_store.commit([K(1)])
    with pytest.raises(ReservationError):
        mem_store.unpin([K(1)])


def test_delete_of_a_pinned_block_frees_it_at_unpin(mem_store):
    put_batch(mem_store, [1, 2])
    mem_store.pin([K(1)])
    assert mem_store.delete([K(1), K(2), K(3)]) == 2
    assert mem_store.contains([K(1), K(2)]) == [False, False]
    assert mem_store.stats().host.allocated_bytes == B
    mem_store.unpin([K(1)])
    assert mem_store.stats().host.allocated_bytes == 0


def test_watermark_demotion_and_promotion_with_exact_counts(ssd_store):
    store, _ = ssd_store
    for i in range(10):
        store.put(K(i), V(i))
    st = store.stats()
    assert st.host.demotions == 0 and st.ssd.blocks == 0  # 10 blocks = the high watermark
    store.put(K(10), V(10))  # 11 > 10: demote the 6 oldest, down to 5
    st = store.stats()
    assert st.host.demotions == 6 and st.host.blocks == 5
    assert st.ssd.blocks == 6 and st.ssd.bytes_in == 6 * B
    assert store._ssd.lru_keys() == [K(i) for i in range(6)]
    assert store.prefix_len([K(i) for i in range(12)]) == 11

    assert store.get(K(0)) == V(0)  # SSD hit: promoted, kept on SSD
    st = store.stats()
    assert (st.host.misses, st.ssd.hits, st.host.promotions) == (1, 1, 1)
    assert st.ssd.bytes_out == B and st.host.blocks == 6 and st.ssd.blocks == 6

    for i in range(20, 25):  # 11 blocks again: demote 6 more, K(0) among them, no rewrite
        store.put(K(i), V(i))
    st = store.stats()
    assert st.host.demotions == 12 and st.ssd.blocks == 11 and st.ssd.bytes_in == 11 * B
    assert store.get(K(99)) is None
    st = store.stats()
    assert (st.host.misses, st.ssd.misses) == (2, 1)


def test_ssd_capacity_evicts_and_corruption_is_a_miss(ssd_store):
    store, _ = ssd_store
    for i in range(60):
        store.put(K(i), V(i))
    st = store.stats()
    assert st.ssd.blocks <= 30 and st.ssd.evictions == st.host.demotions - st.ssd.blocks
    survivors = [i for i in range(60) if store.contains([K(i)])[0]]
    assert survivors == list(range(60 - len(survivors), 60))  # oldest went first
    victim = K(survivors[0])
    env = store._ssd._env
    db = env.open_db(b"data")
    with env.begin(write=True) as txn:
        txn.put(victim, b"\0" * B, db=db)
    assert store.get(victim) is None
    st = store.stats()
    assert st.ssd.corrupt == 1 and not store.contains([victim])[0]


def test_blocks_that_reached_ssd_are_served_after_reopen(ssd_store):
    store, cfg = ssd_store
    for i in range(16):
        store.put(K(i), V(i))
    on_ssd = [i for i in range(16) if K(i) in store._ssd]
    assert len(on_ssd) == 6
    store.close()
    again = BlockStore(cfg)
    try:
        assert again.contains([K(i) for i in range(16)]) == [i in on_ssd for i in range(16)]
        assert all(again.get(K(i)) == V(i) for i in on_ssd)
    finally:
        again.close()


def test_concurrent_puts_of_one_key_keep_one_copy(mem_store):
    n = 8
    barrier = threading.Barrier(n)
    results = []

    def worker(t: int):
        barrier.wait()
        results.append(mem_store.put(K(7), V(7)))

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=10)
    assert sorted(results) == [False] * (n - 1) + [True]
    st = mem_store.stats()
    assert st.host.blocks == 1 and st.host.allocated_bytes == B and mem_store.get(K(7)) == V(7)


def test_concurrent_readers_and_writers_never_see_wrong_bytes(ssd_store):
    store, _ = ssd_store
    errors: list[str] = []

    def worker(t: int):
        for j in range(150):
            i = (t * 37 + j) % 40
            store.put(K(i), V(i))
            got = store.get(K((i * 7) % 40))
            if got is not None and got != V((i * 7) % 40):
                errors.append(f"wrong bytes for {(i * 7) % 40}")

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=30)
    assert not errors
    st = store.stats()
    assert st.host.allocated_bytes <= 20 * B and st.host.blocks == len(store._host)
