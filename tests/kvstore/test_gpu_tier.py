"""The optional CUDA tier (runs only where CUDA exists)."""

from __future__ import annotations

import pytest

from kvstore.keys import BlockKey
from kvstore.store import BlockStore, StoreConfig

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

B = 4096


def K(i: int) -> BlockKey:
    return BlockKey(i.to_bytes(16, "little"))


def V(i: int) -> bytes:
    return (i.to_bytes(16, "little") * (B // 16))[:B]


def test_gpu_tier_moves_blocks_down_and_back(tmp_path):
    cfg = StoreConfig(memory_bytes=20 * B, gpu_memory_bytes=4 * B, ssd_path=str(tmp_path),
                      ssd_capacity_bytes=100 * B, high_watermark=0.5, low_watermark=0.25)
    with BlockStore(cfg) as store:
        for i in range(11):  # demotes 6: 4 fit the GPU, its 2 oldest go on to SSD
            store.put(K(i), V(i))
        st = store.stats()
        assert st.host.demotions == 6 and st.gpu.blocks == 4 and st.gpu.demotions == 2
        assert st.ssd.blocks == 2 and store._gpu.lru_keys() == [K(i) for i in (2, 3, 4, 5)]
        assert all(store.get(K(i)) == V(i) for i in range(11))
        st = store.stats()
        assert st.gpu.hits == 4 and st.ssd.hits == 2 and st.gpu.blocks <= 4


def test_gpu_tier_alone_evicts_its_lru(tmp_path):
    cfg = StoreConfig(memory_bytes=20 * B, gpu_memory_bytes=2 * B, high_watermark=0.5,
                      low_watermark=0.25)
    with BlockStore(cfg) as store:
        for i in range(11):
            store.put(K(i), V(i))
        st = store.stats()
        assert st.gpu.evictions == 4 and st.gpu.blocks == 2
        assert store.contains([K(i) for i in range(6)]) == [False] * 4 + [True] * 2
        assert store.get(K(5)) == V(5)
