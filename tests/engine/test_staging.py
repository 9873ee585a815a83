"""The connector's host staging pools (kvstore.transfer.staging): one warm buffer per request size
serves every later load and save, so a request allocates nothing once the pool is warm (on
CUDA those buffers are pinned and a fresh one costs a cudaHostAlloc); a buffer whose copy may
still run is handed out again only after its event says the copy is done."""

from __future__ import annotations

import pytest
import torch

from engine.kv.connector import KVStoreConnector
from kvstore.transfer.staging import StagingPool
from tests.engine.connector_kit import DictStore, make_cache

ROUNDS = 30


def test_many_loads_and_saves_allocate_nothing_once_warm(load_path, keys):
    """Each round a request saves five blocks (and waits for them) and three requests load one,
    three and five; the first round warms the pools, the next ``ROUNDS`` allocate nothing."""
    store = DictStore()
    cache = make_cache(seed=0)
    want = {i: cache[:, :, i].clone() for i in range(5)}
    conn = KVStoreConnector(store, cache, save_all=True)
    try:
        def one_round(r: int) -> None:
            conn.save_blocks(keys[:5], [0, 1, 2, 3, 4], request_id=f"s{r}")
            conn.flush(f"s{r}").result(timeout=30)
            for n, first in ((1, 5), (3, 6), (5, 9)):
                res = conn.load_blocks(keys[:n], list(range(first, first + n)))
                assert res.loaded == n, res

        conn.save_blocks(keys[:5], [0, 1, 2, 3, 4], request_id="warm")
        conn.flush("warm").result(timeout=30)
        one_round(0)
        warm = conn.staging_allocations()
        assert warm >= 1
        for r in range(1, ROUNDS + 1):
            one_round(r)
        assert conn.staging_allocations() == warm
        # The reused buffers carried every load's own bytes, not a stale request's.
        for slot, block in ((5, 0), (6, 0), (7, 1), (8, 2), (9, 0), (13, 4)):
            assert torch.equal(cache[:, :, slot], want[block]), (slot, block)
    finally:
        conn.close()


class FakeEvent:
    """A CUDA event's one method the pool calls."""

    def __init__(self) -> None:
        self.waited = 0

    def synchronize(self) -> None:
        self.waited += 1


def test_a_buffer_is_handed_out_again_only_after_its_copy():
    pool = StagingPool((4,), torch.uint8, pin=False)
    buf = pool.take(3)
    ready = FakeEvent()
    pool.give(buf, ready)  # type: ignore[arg-type]
    assert ready.waited == 0  # giving back never waits
    again = pool.take(4)
    assert again.data_ptr() == buf.data_ptr() and ready.waited == 1
    assert pool.allocations == 1
    other = pool.take(4)  # the one buffer is out: a second one is made, nothing waited
    assert other.data_ptr() != buf.data_ptr() and pool.allocations == 2 and ready.waited == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_loads_and_saves_reuse_pinned_buffers(keys):
    store = DictStore()
    cache = make_cache(seed=0).cuda()
    conn = KVStoreConnector(store, cache, save_all=True)
    try:
        for r in range(6):
            conn.save_blocks(keys[:5], [0, 1, 2, 3, 4], request_id=f"s{r}")
            conn.flush(f"s{r}").result(timeout=30)
            assert conn.load_blocks(keys[:5], [9, 10, 11, 12, 13]).loaded == 5
            if r == 0:
                warm = conn.staging_allocations()
        assert conn.staging_allocations() == warm
        assert all(b.is_pinned() for free in conn._pool._free.values() for b, _ in free)
        torch.cuda.synchronize()
        assert torch.equal(cache[:, :, 13], cache[:, :, 4])
    finally:
        conn.close()
