"""The optional GPU tier. Its policy runs here on CPU tensors; the CUDA run needs a GPU."""

from __future__ import annotations

import pytest

import kvstore.node.gpu_tier
from kvstore.keys import BlockKey
from kvstore.node.store import BlockStore, StoreConfig

torch = pytest.importorskip("torch")
B = 4096


def K(i: int) -> BlockKey:
    return BlockKey(i.to_bytes(16, "little"))


def V(i: int) -> bytes:
    return (i.to_bytes(16, "little") * (B // 16))[:B]


@pytest.fixture(params=[
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs CUDA")]),
])
def device(request, monkeypatch):
    torch.set_num_threads(1)
    monkeypatch.setattr(kvstore.node.gpu_tier, "DEFAULT_DEVICE", request.param)
    return request.param


def test_gpu_tier_takes_host_demotions_and_spills_to_ssd(tmp_path, device):
    cfg = StoreConfig(memory_bytes=20 * B, gpu_memory_bytes=4 * B, ssd_path=str(tmp_path),
                      ssd_capacity_bytes=100 * B, high_watermark=0.5, low_watermark=0.25)
    with BlockStore(cfg) as store:
        for i in range(11):  # demotes 6: the GPU keeps 4, its 2 oldest go on to SSD
            store.put(K(i), V(i))
        st = store.stats()
        assert st.host.demotions == 6 and st.gpu.blocks == 4 and st.gpu.demotions == 2
        assert st.ssd.blocks == 2 and store._gpu.lru_keys() == [K(i) for i in (2, 3, 4, 5)]
        assert [store.get(K(i)) == V(i) for i in range(6)] == [True] * 6
        st = store.stats()
        assert (st.ssd.hits, st.gpu.hits, st.host.promotions) == (2, 4, 6)
        assert all(store.get(K(i)) == V(i) for i in range(11))


def test_gpu_tier_alone_evicts_its_lru(device):
    cfg = StoreConfig(memory_bytes=20 * B, gpu_memory_bytes=2 * B, high_watermark=0.5,
                      low_watermark=0.25)
    with BlockStore(cfg) as store:
        for i in range(11):
            store.put(K(i), V(i))
        st = store.stats()
        assert st.gpu.evictions == 4 and st.gpu.blocks == 2
        assert store.contains([K(i) for i in range(6)]) == [False] * 4 + [True] * 2
        assert store.get(K(5)) == V(5) and store.stats().gpu.hits == 1


def test_a_closed_gpu_tier_frees_its_memory_and_stores_nothing():
    tier = kvstore.node.gpu_tier.GpuTier(4 * B, device="cpu")
    assert tier.put(K(1), 7, bytearray(V(1))) == [] and tier.size_of(K(1)) == B
    tier.close()
    assert len(tier) == 0 and tier.value_bytes == 0
    assert tier.put(K(2), 7, bytearray(V(2))) == [] and tier.size_of(K(2)) is None  # was a TypeError
