"""The shared-memory index (kvstore/node/shared_index.py) in-process: layout, probing, the
seqlock under a concurrent writer (native and NumPy readers), and the store's use of it."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from kvstore.keys import BlockKey
from kvstore.native import seqlock
from kvstore.node import shared_index as si
from kvstore.node.arena import Arena
from kvstore.node.store import BlockStore, StoreConfig

READERS = ["native", "object", "python"]  # get_into via kv_read, read_obj via kv_read_obj, NumPy


def K(home: int, tag: int = 0) -> BlockKey:
    """A key whose home slot is ``home`` (mod the table size) and whose tail is ``tag``."""
    return BlockKey(home.to_bytes(8, "little") + tag.to_bytes(8, "little"))


def content(key: bytes, size: int) -> np.ndarray:
    """A block's bytes as a function of its key: any foreign or torn byte shows."""
    return np.frombuffer(key * (size // 16), np.uint8)


@pytest.fixture
def pair():
    """(index, reader over the same arena, arena array); arena of 1 MiB, 1024 slots."""
    arena = Arena.create(1 << 20)
    index = si.SharedIndex.create(arena.size, slots=1024)
    assert index is not None
    arr = np.frombuffer(arena.buf, np.uint8)
    reader = si.IndexReader.attach(index.info(), arr)
    assert reader is not None
    yield index, reader, arr
    reader.close()
    index.close()
    del arr
    arena.close()


def read(reader: si.IndexReader, how: str, key: bytes, dst: np.ndarray) -> tuple[int, int]:
    if how == "native":
        assert reader.native, seqlock.LIBRARY.why
        return reader.get_into(key, dst)
    if how == "object":
        assert reader.reads_objects, seqlock.PY_LIBRARY.why
        return seqlock.unfold(reader.read_obj(key, dst))
    return reader._get_python(key, dst)


@pytest.mark.parametrize("how", READERS)
def test_publish_read_retract_and_probing(pair, how):
    index, reader, arena = pair
    dst = np.zeros(4096, np.uint8)
    keys = [K(7, t) for t in range(3)]  # one home slot: linear probing
    for i, k in enumerate(keys):
        arena[i * 4096: (i + 1) * 4096] = content(k, 4096)
        assert index.publish(k, i * 4096, 4096)
    for k in keys:
        assert read(reader, how, k, dst) == (si.HIT, 4096) and np.array_equal(dst, content(k, 4096))
    index.retract(keys[0])  # a tombstone in front: the others are still found past it
    assert read(reader, how, keys[0], dst)[0] == si.MISS
    assert read(reader, how, keys[2], dst) == (si.HIT, 4096)
    assert read(reader, how, K(8, 99), dst)[0] == si.MISS  # keys[1]'s slot, another key
    assert read(reader, how, keys[1], np.zeros(100, np.uint8)) == (si.SMALL, 4096)
    if how == "object":  # any writable C-contiguous buffer object; anything else is BADBUF
        ba = bytearray(5000)
        assert reader.read_obj(keys[1], ba) == 4096 and ba[:4096] == content(keys[1], 4096).tobytes()
        assert seqlock.unfold(reader.read_obj(keys[1], b"x" * 5000))[0] == si.BADBUF
        assert seqlock.unfold(reader.read_obj(keys[1], np.zeros((64, 128), np.uint8)[:, :64]))[0] == si.BADBUF
    assert index.publish(K(7, 50), 0, 64)  # reuses the tombstone
    assert index._slot_of[K(7, 50)] == 7
    index.close()
    assert read(reader, how, keys[2], dst)[0] == si.CLOSED and not reader.live


def test_a_full_probe_window_is_not_published(pair):
    index, reader, _ = pair
    assert all(index.publish(K(3, t), 0, 64) for t in range(si.MAX_PROBE))
    assert not index.publish(K(3, 999), 0, 64) and index.overflow == 1
    assert reader.get_into(K(3, 999), np.zeros(64, np.uint8))[0] == si.MISS


def test_attach_refuses_another_instance_or_a_closed_index(pair):
    index, _, arena = pair
    info = index.info()
    assert si.IndexReader.attach({**info, "instance": info["instance"] ^ 1}, arena) is None
    assert si.IndexReader.attach({**info, "name": "kvstore-0-00000000"}, arena) is None
    assert si.IndexReader.attach(info, arena[:4096]) is None  # over another arena size
    index.close()
    assert si.IndexReader.attach(info, arena) is None


@pytest.mark.parametrize("how", READERS)
def test_no_torn_or_foreign_bytes_under_a_concurrent_writer(pair, how):
    """A writer moves keys between a few 64 KiB places as the daemon does (retract, overwrite
    the space with another key's bytes, publish that key there) while a reader copies: every
    HIT must be exactly its key's bytes. The same copies made without the version check are
    torn now and then, which is what shows the race is exercised."""
    index, reader, arena = pair
    size, places = 64 << 10, 8
    pool = [BlockKey(os.urandom(16)) for _ in range(32)]
    where: dict[int, BlockKey] = {}
    stop = threading.Event()

    def writer() -> None:
        rng = np.random.default_rng(1)
        while not stop.is_set():
            p = int(rng.integers(places))
            old, new = where.get(p), pool[int(rng.integers(len(pool)))]
            if new in index:
                continue
            if old is not None:
                index.retract(old)  # first: before the space is written again
            arena[p * size: (p + 1) * size] = content(new, size)
            index.publish(new, p * size, size)  # last: once the bytes are in
            where[p] = new

    t = threading.Thread(target=writer, daemon=True)
    t.start()
    dst = np.zeros(size, np.uint8)
    hits = busy = torn_unchecked = n = 0
    deadline = time.monotonic() + 1.5
    try:
        while time.monotonic() < deadline and n < 200_000:
            n += 1
            k = pool[n % len(pool)]
            rc, got = read(reader, how, k, dst)
            if rc == si.HIT:
                hits += 1
                assert got == size and np.array_equal(dst, content(k, size)), "torn or foreign bytes"
            busy += rc == si.BUSY
            if n % 4 == 0:  # the unchecked copy of whatever place holds k now
                p = next((p for p, v in list(where.items()) if v == k), None)
                if p is not None:
                    raw = arena[p * size: (p + 1) * size].copy()
                    torn_unchecked += not np.array_equal(raw, content(k, size))
    finally:
        stop.set()
        t.join(5)
    print(f"{how}: {n} reads, {hits} hits, {busy} busy, {torn_unchecked} torn unchecked copies")
    assert hits > 100, (hits, busy, n)
    assert torn_unchecked > 0, "the writer never raced the reader: the test tests nothing"


def test_the_store_publishes_committed_blocks_and_retracts_before_reuse():
    store = BlockStore(StoreConfig(memory_bytes=8 * 4096, high_watermark=1.0, low_watermark=1.0))
    try:
        index = store.index
        assert index is not None
        arena = np.frombuffer(store.arena.buf, np.uint8)
        reader = si.IndexReader.attach(index.info(), arena)
        assert reader is not None
        dst = np.zeros(4096, np.uint8)
        keys = [BlockKey(os.urandom(16)) for _ in range(10)]
        (res,) = store.reserve([(keys[0], 4096)])
        assert res is not None and keys[0] not in index  # reserved: not yet findable
        store.arena.buf[res.offset: res.offset + 4096] = content(keys[0], 4096).tobytes()
        store.commit([keys[0]])
        assert reader.get_into(keys[0], dst) == (si.HIT, 4096)
        for k in keys[1:8]:
            store.put(k, content(k, 4096).tobytes())
        assert store.pin([keys[1]]) != [None]
        store.delete([keys[1]])  # pinned: hidden at once, from the index too
        assert keys[1] not in index and reader.get_into(keys[1], dst)[0] == si.MISS
        store.unpin([keys[1]])
        store.put(keys[8], content(keys[8], 4096).tobytes())  # into keys[1]'s freed space
        store.put(keys[9], content(keys[9], 4096).tobytes())  # evicts the LRU one: keys[0]
        assert keys[0] not in index and reader.get_into(keys[0], dst)[0] == si.MISS
        assert reader.get_into(keys[9], dst) == (si.HIT, 4096) and np.array_equal(dst, content(keys[9], 4096))
        assert index.published == len(store.held_keys()) == 8
        reader.close()
        del arena
    finally:
        store.close()
    assert store.index is not None and store.index.region.closed


def test_touch_orders_recency_and_counts_hits():
    store = BlockStore(StoreConfig(memory_bytes=4 * 4096, high_watermark=1.0, low_watermark=1.0))
    try:
        keys = [BlockKey(os.urandom(16)) for _ in range(5)]
        for k in keys[:4]:
            store.put(k, b"x" * 4096)
        # reads reported oldest first: keys[1] then keys[0] (a batch [0, 1] read tail first)
        assert store.touch([keys[1], keys[0]], [2, 1], [4096, 4096]) == 3 * 4096
        assert store.stats().host.hits == 3
        store.put(keys[4], b"y" * 4096)  # evicts the least recent: keys[2]
        assert store.contains(keys) == [True, True, False, True, True]
        store.touch([keys[3]], [1], [4096])  # gone or not, a read is a hit
        assert store.stats().host.hits == 4
    finally:
        store.close()


def test_no_index_where_no_correct_writer_exists(monkeypatch):
    monkeypatch.setattr(si, "_native", lambda: None)
    monkeypatch.setattr(si, "python_path_is_correct", lambda: False)
    assert si.SharedIndex.create(1 << 20) is None
    with BlockStore(StoreConfig(memory_bytes=1 << 20)) as store:
        assert store.index is None and store.put(K(1), b"z" * 64)
