"""The one-hop handoff (engine.kv.handoff) on real daemons registered in a real etcd: a
prefill's blocks go to this host's node, not their owners; a decode given that node as its
source loads them from there; the background placer copies them on to their owners."""

from __future__ import annotations

import time
import uuid

import pytest
import torch

from engine.kv.connector import KVStoreConnector
from kvstore.client.cluster import ClusterClient
from kvstore.keys import block_keys, namespace_id
from tests.engine.connector_kit import BS, NB, make_cache

pytestmark = pytest.mark.integration

torch.set_num_threads(1)


def _poll(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_prefill_hands_off_to_its_host_node_and_decode_reads_it_there(etcd, start_daemon):
    cluster = f"h{uuid.uuid4().hex[:8]}"
    for _ in range(2):
        start_daemon("--etcd", etcd, "--cluster", cluster, "--repair-rate", "0")  # the placer alone
    keys = block_keys(namespace_id({"test": "handoff"}), list(range(12 * BS)), BS)  # 12 blocks
    with ClusterClient(etcd, cluster) as cc:
        assert cc.wait_for_nodes(2, 10.0)
        local = cc.local_node_id          # both daemons run on this host: one is "local"
        assert local is not None
        other = next(n for n in cc.nodes if n != local)
        owned_elsewhere = [k for k in keys if cc.owners(k)[0] == other]
        assert owned_elsewhere, "rendezvous gives the other node some of 12 blocks"

        cache = make_cache(seed=1)
        prefill = KVStoreConnector(cc, cache, save_all=False)
        prefill.save_blocks(keys, list(range(len(keys))), request_id="r1",
                            node=cc.local_node_id)
        result = prefill.flush("r1").result(timeout=10)
        assert result.saved_blocks == len(keys) and result.node == local
        stats = prefill.stats_snapshot()
        assert stats.handoff_blocks == len(keys)
        # On the request path every block went to the local node, none to the other one...
        local_client, other_client = cc.node_client(local), cc.node_client(other)
        assert local_client is not None and other_client is not None
        assert all(local_client.contains(keys))
        # ...and the placer copies the ones the other node owns there, in the background.
        _poll(lambda: all(other_client.contains(owned_elsewhere)), 10, "the placer's copies")
        _poll(lambda: prefill.placer_idle, 10, "the placer")
        assert prefill.stats_snapshot().placed_blocks == len(owned_elsewhere), (
            prefill.stats_snapshot(), len(owned_elsewhere))

        # A decode told where the blocks are loads every one of them from that node.
        other_client.delete(owned_elsewhere)          # only the source holds them now
        decode_cache = torch.zeros_like(cache)
        decode = KVStoreConnector(cc, decode_cache, save_all=False)
        assert decode.lookup(keys) < len(keys)                   # the owners lack some
        assert decode.lookup(keys, source=local) == len(keys)
        loaded = decode.load_blocks(keys, list(range(len(keys))), source=local)
        assert loaded.loaded == len(keys)
        assert torch.equal(decode_cache[:, :, :len(keys)], cache[:, :, :len(keys)])
        assert decode.stats_snapshot().source_hit_blocks == len(keys)
        # A source that is not registered is a miss there, not an error: the owners serve.
        assert decode.lookup(keys, source="no-such-node") == decode.lookup(keys)
        prefill.close()
        decode.close()
    assert NB >= len(keys)
