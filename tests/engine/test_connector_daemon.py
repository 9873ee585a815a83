"""The connector's load against a real daemon, over shared memory and over TCP: each block is
verified where it lies (the pinned arena; the staging row it just landed in) and lands in its
slot; a block damaged inside the daemon's arena is caught, and its slot is left alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.kv.connector import KVStoreConnector
from kvstore import Client
from kvstore.client.scatter import scatter_kernel
from kvstore.keys import block_keys, namespace_id
from kvstore.native.blocks import LIBRARY
from kvstore.node.arena import Arena
from tests.native import require_native

L, BS, H, D, NB = 4, 4, 2, 16, 24


def _cache(seed: int) -> torch.Tensor:
    return torch.randn((L, 2, NB, BS, H, D), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.parametrize("threads", [1, 2])
def test_loads_from_a_real_daemon_verify_where_the_blocks_lie(shared_daemon, transport, threads):
    require_native(scatter_kernel() is not None, "the scatter kernel", LIBRARY.why)
    daemon = shared_daemon
    keys = block_keys(namespace_id({"t": "scatter", "case": [transport, threads]}), list(range(10 * BS)), BS)
    src, dst = _cache(threads + 10 * (transport == "tcp")), _cache(100)
    with Client(daemon.address, transport=transport) as client:
        assert client.transport == transport
        saver = KVStoreConnector(client, src)
        saver.save_blocks(keys, list(range(10)), request_id="s")
        assert saver.flush("s").result(timeout=30).saved_blocks == 10
        saver.close()
        conn = KVStoreConnector(client, dst, save_all=False, load_threads=threads)
        ids = list(range(23, 13, -1))
        res = conn.load_blocks(keys, ids)
        assert (res.loaded, res.corrupt, res.missing) == (10, 0, 0)
        for i, b in enumerate(ids):
            assert torch.equal(dst[:, :, b], src[:, :, i])

        # Damage block 6 inside the daemon's arena: the next load stops there.
        arena = Arena.attach(daemon.arena)
        try:
            view = np.frombuffer(arena.buf, np.uint8)
            payload = src[:, :, 6].contiguous().view(torch.uint8).numpy().tobytes()
            at = bytes(view).find(payload[:4096])
            assert at > 0
            view[at + 17] ^= 0xFF
            dst[:, :, 6:14] = 0.0
            res = conn.load_blocks(keys, list(range(4, 14)))
            assert (res.loaded, res.corrupt) == (6, 1)
            for i in range(6):
                assert torch.equal(dst[:, :, 4 + i], src[:, :, i])
            assert not dst[:, :, 10].any()  # block 6's slot: nothing written
            del view
        finally:
            arena.close()


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_staged_load_sends_verified_groups_and_stops_at_a_bad_block(shared_daemon, transport):
    """CUDA's path, run on a CPU cache: verified rows of a pinned ring go on in groups of 16."""
    require_native(scatter_kernel() is not None, "the scatter kernel", LIBRARY.why)
    keys = block_keys(namespace_id({"t": "staged", "tr": transport}), list(range(20 * BS)), BS)
    src = torch.randn((L, 2, 20, BS, H, D), generator=torch.Generator().manual_seed(3))
    dst = torch.zeros((L, 2, 40, BS, H, D))
    with Client(shared_daemon.address, transport=transport) as client:
        saver = KVStoreConnector(client, src)
        saver.save_blocks(keys, list(range(20)), request_id="s")
        assert saver.flush("s").result(timeout=30).saved_blocks == 20
        saver.close()
        conn = KVStoreConnector(client, dst, save_all=False, load_threads=1, load_path="staged")
        assert conn.load_blocks(keys, list(range(20, 40))).loaded == 20
        assert torch.equal(dst[:, :, 20:40], src)
        client.delete(keys[18:19])
        dst.zero_()
        res = conn.load_blocks(keys, list(range(20, 40)))
        assert (res.loaded, res.missing) == (18, 1)
        assert torch.equal(dst[:, :, 20:38], src[:, :, :18]) and not dst[:, :, 38:].any()
