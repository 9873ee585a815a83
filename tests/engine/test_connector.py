"""KVStoreConnector data path: encode/save, lookup, verified load, corrupt and missing blocks.

The store here is a small in-memory stand-in with the client's batch API (the connector is
the unit under test); the process-level path against a real daemon is in test_disagg.py.
"""

from __future__ import annotations

import time

import pytest
import torch

from engine.kv.connector import KVStoreConnector
from kvstore import codec
from kvstore.keys import namespace_id
from kvstore.native.blocks import LIBRARY
from kvstore.net.buffers import Sink
from tests.engine.connector_kit import BS, D, DictStore, H, L, make_cache
from tests.native import require_native

torch.set_num_threads(1)

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_save_then_load_round_trips_into_other_blocks(load_path, keys, dtype):
    store = DictStore()
    src, dst = make_cache(dtype, 0), make_cache(dtype, 1)
    saver, loader = KVStoreConnector(store, src), KVStoreConnector(store, dst)
    saver.save_blocks(keys[:3], [7, 2, 9], request_id="r")
    saver.save_blocks(keys[3:], [0, 15], request_id="r")
    result = saver.flush("r").result(timeout=10)
    assert result.saved_blocks == 5 and result.failed_blocks == 0
    assert result.bytes == 5 * L * 2 * BS * H * D * src.element_size()

    # The stored value is the codec encoding of the canonical layout.
    header, payload = codec.decode(store.data[bytes(keys[0])], expected_key=keys[0])
    assert header.shape == (L, 2, BS, H, D) and header.dtype == str(dtype).split(".")[1]
    assert bytes(payload) == src[:, :, 7].contiguous().view(torch.uint8).numpy().tobytes()

    assert loader.lookup(keys) == 5
    res = loader.load_blocks(keys, [1, 3, 4, 5, 6])
    assert (res.loaded, res.missing, res.corrupt) == (5, 0, 0)
    for src_id, dst_id in zip([7, 2, 9, 0, 15], [1, 3, 4, 5, 6]):
        assert torch.equal(dst[:, :, dst_id], src[:, :, src_id])
    assert loader.stats.loaded_blocks == 5 and loader.stats.loaded_bytes == result.bytes
    saver.close()


def test_saved_blocks_are_a_copy_taken_at_save_time(keys):
    store = DictStore()
    cache = make_cache()
    before = cache[:, :, 4].clone()
    conn = KVStoreConnector(store, cache)
    conn.save_blocks(keys[:1], [4], request_id="x")
    cache[:, :, 4] = 0.0  # the engine reuses the block right away
    assert conn.flush("x").result(timeout=10).saved_blocks == 1
    _, payload = codec.decode(store.data[bytes(keys[0])], expected_key=keys[0])
    assert bytes(payload) == before.contiguous().numpy().tobytes()
    conn.close()


def test_corrupt_block_stops_the_load_and_is_counted(load_path, keys):
    store = DictStore()
    src, dst = make_cache(seed=0), make_cache(seed=1)
    saver = KVStoreConnector(store, src)
    saver.save_blocks(keys, [0, 1, 2, 3, 4], request_id="s")
    saver.flush("s").result(timeout=10)
    conn = KVStoreConnector(store, dst)
    assert conn.flush().done()  # no saver thread on this connector: resolves at once

    bad = bytearray(store.data[bytes(keys[2])])
    bad[-1] ^= 0xFF  # flip a payload bit
    store.data[bytes(keys[2])] = bytes(bad)
    untouched = dst[:, :, 10:16].clone()
    res = conn.load_blocks(keys, [10, 11, 12, 13, 14])
    assert (res.loaded, res.corrupt, res.missing) == (2, 1, 0)
    assert torch.equal(dst[:, :, 10], src[:, :, 0]) and torch.equal(dst[:, :, 11], src[:, :, 1])
    # The corrupt block and everything after it never reached the cache.
    assert torch.equal(dst[:, :, 12:16], untouched[:, :, 2:])
    assert conn.stats.corrupt_blocks == 1


def test_misfiled_block_is_corrupt(load_path, keys):
    store = DictStore()
    src, dst = make_cache(seed=0), make_cache(seed=1)
    s = KVStoreConnector(store, src)
    s.save_blocks(keys[:2], [0, 1], request_id="s")
    s.flush("s").result(timeout=10)
    store.data[bytes(keys[0])] = store.data[bytes(keys[1])]  # right bytes, wrong key
    res = KVStoreConnector(store, dst).load_blocks(keys[:2], [0, 1])
    assert res.loaded == 0 and res.corrupt == 1


def test_missing_block_and_unreachable_store_are_misses(load_path, keys):
    store = DictStore()
    src, dst = make_cache(seed=0), make_cache(seed=1)
    s = KVStoreConnector(store, src)
    s.save_blocks(keys[:3], [0, 1, 2], request_id="s")
    s.flush("s").result(timeout=10)
    del store.data[bytes(keys[1])]
    conn = KVStoreConnector(store, dst)
    assert conn.lookup(keys) == 1
    res = conn.load_blocks(keys[:3], [5, 6, 7])
    assert (res.loaded, res.missing) == (1, 1)

    store.down = True
    assert conn.lookup(keys) == 0
    assert conn.load_blocks(keys[:1], [8]).loaded == 0
    s.save_blocks(keys[:1], [0], request_id="t")
    assert s.flush("t").result(timeout=10).failed_blocks == 1
    assert s.stats_snapshot().save_failed_blocks == 1 and conn.stats.store_errors == 2
    s.close()


def test_saves_coalesce_into_batched_puts(keys):
    store = DictStore()
    cache = make_cache()
    block_bytes = codec.encoded_size("float32", (L, 2, BS, H, D))
    conn = KVStoreConnector(store, cache, max_batch_bytes=2 * block_bytes)
    conn.save_blocks(keys, [0, 1, 2, 3, 4], request_id="r")  # 5 blocks, batches of 2
    assert conn.flush("r").result(timeout=10).saved_blocks == 5
    assert store.puts == 3 and len(store.data) == 5
    conn.close()


def test_bad_cache_shape_is_rejected():
    with pytest.raises(ValueError, match="kv_cache must be"):
        KVStoreConnector(DictStore(), torch.zeros(2, 2, 4))
    with pytest.raises(ValueError, match="no block codec"):
        KVStoreConnector(DictStore(), torch.zeros((1, 2, 1, 1, 1, 1), dtype=torch.int64))


def _poll_loads(conn: KVStoreConnector, timeout: float = 10.0) -> list:
    """``finished_loads`` until one ends (``wait`` sleeps until the loader reports)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if done := conn.finished_loads():
            return done
        conn.wait(0.5)
    raise AssertionError("no load ended")


def test_engine_protocol_maps_a_request_onto_the_store():
    from engine.api.generate import SamplingParams
    from engine.core.connector_api import EngineConnector
    from engine.core.request import Request

    store = DictStore()
    src, dst = make_cache(seed=0), make_cache(seed=1)
    req = Request("r", list(range(3 * BS + 2)), SamplingParams(max_tokens=4),
                   namespace=namespace_id({"test": "protocol"}), block_size=BS)
    saver = KVStoreConnector(store, src)
    assert isinstance(saver, EngineConnector)
    saver.save(req, [4, 5, 6], req.block_keys[:3])
    assert saver.flush("r").result(timeout=10).saved_blocks == 3

    # A decode worker's default; lookup_wait_s=0: the scheduler never waits for an answer.
    loader = KVStoreConnector(store, dst, save_all=False, lookup_wait_s=0.0)
    woken = []
    loader.on_ready = lambda: woken.append(1)
    loader.lookup_ahead(req)   # answered on the lookup thread, from block 0
    deadline = time.monotonic() + 10
    while (hits := loader.get_num_external_hits(req, BS)) is None and time.monotonic() < deadline:
        loader.wait(0.5)
    assert hits == 2 * BS and woken  # after one device-hit block
    assert loader.get_num_external_hits(req, 0) is None  # an answer is used once: asked again
    deadline = time.monotonic() + 10
    while (hits := loader.get_num_external_hits(req, 0)) is None and time.monotonic() < deadline:
        loader.wait(0.5)
    assert hits == 3 * BS
    req.num_computed_tokens = BS
    loader.start_load(req, [9, 10])
    (done,) = _poll_loads(loader)
    assert done.request_id == "r" and done.tally.loaded == 2
    assert done.tally.bytes == 2 * L * 2 * BS * H * D * 4
    assert torch.equal(dst[:, :, 9], src[:, :, 5]) and torch.equal(dst[:, :, 10], src[:, :, 6])
    assert loader.finished_loads() == []  # each load ends once

    del store.data[bytes(req.block_keys[1])]
    loader.save(req, [9], req.block_keys[1:2])  # not saved: save_all is off ...
    assert loader.flush("r").result(timeout=10).saved_blocks == 0
    req.kv.save = True  # ... unless the request says so (a prefill for a decode elsewhere)
    loader.save(req, [9], req.block_keys[1:2])
    assert loader.flush("r").result(timeout=10).saved_blocks == 1
    assert bytes(req.block_keys[1]) in store.data
    loader.close()

    assert KVStoreConnector(store, dst, load_enabled=False).get_num_external_hits(req, 0) == 0


class SlowLookups(DictStore):
    """A DictStore whose ``prefix_len`` takes ``delay`` seconds."""

    def __init__(self, delay: float) -> None:
        super().__init__()
        self.delay = delay

    def prefix_len(self, keys) -> int:
        time.sleep(self.delay)
        return super().prefix_len(keys)


def test_a_lookup_just_sent_is_waited_for_briefly_never_long():
    from engine.api.generate import SamplingParams
    from engine.core.request import Request

    def request(rid: str) -> Request:
        return Request(rid, list(range(3 * BS + 2)), SamplingParams(max_tokens=4),
                       namespace=namespace_id({"test": "wait"}), block_size=BS)

    quick = KVStoreConnector(SlowLookups(0.0), make_cache(), lookup_wait_s=5.0)
    a = request("a")
    quick.lookup_ahead(a)
    assert quick.get_num_external_hits(a, 0) == 0   # answered within the wait: no step lost
    slow = KVStoreConnector(SlowLookups(1.0), make_cache(), lookup_wait_s=0.05)
    b = request("b")
    slow.lookup_ahead(b)
    t0 = time.monotonic()
    assert slow.get_num_external_hits(b, 0) is None   # not in after 50 ms: asked next step
    assert time.monotonic() - t0 < 0.5
    quick.close()
    slow.close()


def test_a_load_that_fails_on_the_loader_thread_ends_with_nothing_loaded(keys):
    from engine.api.generate import SamplingParams
    from engine.core.request import Request

    store = DictStore()
    req = Request("r", list(range(3 * BS + 2)), SamplingParams(max_tokens=4),
                   namespace=namespace_id({"test": "protocol"}), block_size=BS)
    conn = KVStoreConnector(store, make_cache())
    conn.load_blocks = lambda *a, **k: 1 / 0  # type: ignore[method-assign]
    conn.start_load(req, [1, 2])
    (done,) = _poll_loads(conn)
    assert (done.tally.loaded, done.tally.requested) == (0, 2)
    conn.start_load(req, [1, 2])   # the thread lives on
    assert _poll_loads(conn)[0].tally.loaded == 0
    conn.close()


def test_present_blocks_are_acknowledged_without_shipping_bytes(keys):
    store = DictStore()
    conn = KVStoreConnector(store, make_cache())
    conn.save_blocks(keys[:2], [0, 1], request_id="a")
    first = conn.flush("a").result(timeout=10)
    conn.save_blocks(keys[:3], [0, 1, 2], request_id="b", recheck=True)  # two already stored
    second = conn.flush("b").result(timeout=10)
    assert first.saved_blocks == 2 and second.saved_blocks == 3
    assert second.bytes == first.bytes // 2  # only the new block travelled
    conn.close()


class RecordingStore(DictStore):
    """A DictStore that keeps every buffer ``get`` was given (so none can be freed and reused
    by the allocator behind the connector's back) and records their addresses."""

    def __init__(self) -> None:
        super().__init__()
        self.buffers: list[list] = []

    def get(self, keys, buffers) -> list[bool]:
        self.buffers.append(list(buffers))
        return super().get(keys, buffers)

    def address(self, call: int) -> int:
        """Where the first block of get ``call`` landed (a sink's staging row, else the buffer)."""
        first = self.buffers[call][0]
        return (first.staging if isinstance(first, Sink) else first).ctypes.data


def test_loads_reuse_one_pooled_staging_buffer(keys):
    store = RecordingStore()
    src, dst = make_cache(seed=0), make_cache(seed=1)
    saver = KVStoreConnector(store, src)
    saver.save_blocks(keys, [0, 1, 2, 3, 4], request_id="s")
    saver.flush("s").result(timeout=10)
    saver.close()
    conn = KVStoreConnector(store, dst)
    assert conn.load_blocks(keys[:2], [8, 9]).loaded == 2
    assert conn.load_blocks(keys[2:4], [10, 11]).loaded == 2  # another request, same size
    assert store.address(1) == store.address(0)  # no allocation once warm
    # A reused buffer holds the last load's bytes: the next load still lands only its own.
    for src_id, dst_id in zip([0, 1, 2, 3], [8, 9, 10, 11]):
        assert torch.equal(dst[:, :, dst_id], src[:, :, src_id])
    del store.data[bytes(keys[1])]
    res = conn.load_blocks(keys[:2], [12, 13])  # keys[1] missing: its stale row is not loaded
    assert (res.loaded, res.missing) == (1, 1)
    assert store.address(2) == store.address(0)
    assert torch.equal(dst[:, :, 12], src[:, :, 0]) and not torch.equal(dst[:, :, 13], src[:, :, 1])


def test_the_load_pool_is_bounded(keys):
    store = RecordingStore()
    conn = KVStoreConnector(store, make_cache())
    for n in (1, 2, 3, 4, 5, 1, 2, 4, 5):  # capacities 1, 2, 4, 4, 8, then all reused
        conn.load_blocks(keys[:n], list(range(n)))
    firsts = {store.address(i) for i in range(len(store.buffers))}
    assert len(firsts) == 4  # one buffer per power-of-two capacity, reused ever after


def test_staging_pool_keeps_at_most_keep_per_size_buffers():
    from kvstore.transfer.staging import StagingPool

    pool = StagingPool((8,), torch.uint8, pin=False, keep_per_size=2)
    bufs = [pool.take(3) for _ in range(3)]  # capacity 4 each
    assert pool.allocations == 3 and all(b.shape == (4, 8) for b in bufs)
    for b in bufs:
        pool.give(b)
    assert pool.kept_bytes == 2 * 4 * 8  # the third was dropped
    again = [pool.take(4), pool.take(2)]
    assert pool.allocations == 4  # capacity 4 reused, capacity 2 new
    assert again[0].data_ptr() in {b.data_ptr() for b in bufs[:2]}


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_threaded_scatter_loads_the_leading_run_and_writes_nothing_of_a_bad_block(keys, threads):
    from kvstore.client.scatter import scatter_kernel

    require_native(scatter_kernel() is not None, "the scatter kernel", LIBRARY.why)
    store = DictStore()
    src, dst = make_cache(seed=0), make_cache(seed=1)
    saver = KVStoreConnector(store, src)
    saver.save_blocks(keys, [0, 1, 2, 3, 4], request_id="s")
    saver.flush("s").result(timeout=10)
    conn = KVStoreConnector(store, dst, load_threads=threads)
    assert conn.load_threads == threads
    res = conn.load_blocks(keys, [10, 11, 12, 13, 14])
    assert res.loaded == 5
    for i in range(5):
        assert torch.equal(dst[:, :, 10 + i], src[:, :, i])
    bad = bytearray(store.data[bytes(keys[1])])
    bad[100] ^= 0x01  # one payload bit
    store.data[bytes(keys[1])] = bytes(bad)
    before = dst[:, :, 5].clone()
    res = conn.load_blocks(keys, [6, 5, 7, 8, 9])
    assert (res.loaded, res.corrupt) == (1, 1)
    assert torch.equal(dst[:, :, 6], src[:, :, 0])
    assert torch.equal(dst[:, :, 5], before)  # the failed block's slot was not written
