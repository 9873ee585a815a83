"""ClusterClient over real daemons registered in a real etcd."""

from __future__ import annotations

import base64
import json
import signal
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest

import kvstore
from kvstore.client.cluster import ClusterClient
from kvstore.client.node import Client
from kvstore.client.placement import Placement
from kvstore.coord import layout
from kvstore.coord.etcd import EtcdClient
from kvstore.errors import StoreUnavailable
from kvstore.keys import block_keys, namespace_id

pytestmark = pytest.mark.integration

BLOCK = 4096
DAEMON_TTL = 2.0  # `kvstore serve --registration-ttl`: short, so the expiry wait is too


def _keys(tag: str, n: int) -> list[bytes]:
    ns = namespace_id({"test": "cluster", "tag": tag})
    return block_keys(ns, np.arange(n * 4, dtype=np.uint32), block_size=4)


def _values(keys) -> list[bytes]:
    return [bytes(k) * (BLOCK // 16) for k in keys]


def _poll(cond, timeout: float, what: str) -> float:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.05)
    return time.monotonic() - t0


@pytest.fixture
def cluster_name() -> str:
    return f"c{uuid.uuid4().hex[:8]}"


@pytest.mark.parametrize("transport", ["auto", "ucx"])  # auto: shared memory, on one host
def test_placement_failover_and_expiry(etcd, start_daemon, cluster_name, transport):
    if transport == "ucx":
        from kvstore.net import ucx

        if ucx.available() is not None:
            pytest.skip(ucx.available())
    extra = ["--ucx"] if transport == "ucx" else []
    daemons = [start_daemon("--etcd", etcd, "--cluster", cluster_name,
                            "--registration-ttl", str(DAEMON_TTL), *extra) for _ in range(3)]
    by_id = {d.node_id: d for d in daemons}
    # R is 1 (the cluster sets none); R = 2 and its repairs: tests/kvstore/test_replication.py
    with ClusterClient(etcd, cluster_name, transport=transport) as cc:
        assert cc.wait_for_nodes(3, 10.0) and cc.replicas == 1
        assert cc.nodes == {d.node_id: d.address for d in daemons}

        keys = _keys("r1", 300)
        values = _values(keys)
        cc.put(keys, values)

        # Every key landed on exactly its rendezvous owner(s), nowhere else.
        placement = Placement(by_id)
        for node, d in by_id.items():
            with Client(d.address, transport="tcp") as c:
                assert c.contains(keys) == [placement.owners(k)[0] == node for k in keys]
        counts = [sum(placement.owners(k)[0] == n for k in keys) for n in by_id]
        assert min(counts) > 50  # spread over all three

        assert cc.get_bytes(keys) == values
        bufs = [bytearray(BLOCK) for _ in keys]
        assert cc.get(keys, bufs) == [True] * len(keys)
        assert [bytes(b) for b in bufs] == values
        missing = _keys("never-put", 5)
        assert cc.contains(keys[:3] + missing) == [True] * 3 + [False] * 5
        assert cc.prefix_len(keys) == len(keys)
        assert cc.prefix_len(keys[:10] + missing) == 10
        assert cc.delete(keys[-5:]) == 5
        assert cc.contains(keys[-5:]) == [False] * 5
        keys, values = keys[:-5], values[:-5]
        assert cc.stats()["nodes"].keys() == by_id.keys()
        assert {cc.node_client(n).transport for n in by_id} == {  # type: ignore[union-attr]
            "shm" if transport == "auto" else transport}

        # One ClusterClient shared by several threads.
        def worker(t: int) -> bool:
            ks = _keys(f"thread{t}", 40)
            cc.put(ks, _values(ks))
            return cc.get_bytes(ks) == _values(ks)

        with ThreadPoolExecutor(4) as pool:
            assert all(pool.map(worker, range(4)))

        # Kill one node: its keys are misses, the rest hit, nothing raises.
        victim = placement.owners(keys[0])[0]
        by_id[victim].stop(signal.SIGKILL)
        t0 = time.monotonic()
        got = cc.get_bytes(keys)
        assert time.monotonic() - t0 < 2.0  # a dead node fails fast
        for k, v, g in zip(keys, values, got):
            assert g == (None if placement.owners(k)[0] == victim else v)
        assert cc.prefix_len(keys) == 0  # keys[0] lived on the victim

        # While the dead node is still registered, writes go to the next-ranked node and
        # reads find them there.
        late = _keys("late", 60)
        cc.put(late, _values(late))
        assert cc.get_bytes(late) == _values(late)

        # It leaves etcd within the TTL; placement then runs over the two live nodes only.
        with EtcdClient(etcd) as ec:
            took = _poll(
                lambda: ec.get(layout.store_key(cluster_name, victim)) is None,
                DAEMON_TTL + 3.0, "the killed daemon's registration to expire",
            )
        assert took <= DAEMON_TTL + 1.5
        _poll(lambda: victim not in cc.nodes, 3.0, "membership to drop the killed node")
        live = Placement(set(by_id) - {victim})
        for k in late:
            assert cc.owners(k) == live.owners(k)
        assert cc.get_bytes(late) == _values(late)

        # No node alive at all: that is an error, not a miss.
        for node, d in by_id.items():
            if node != victim:
                d.stop(signal.SIGKILL)
        with pytest.raises(StoreUnavailable):
            cc.get_bytes(keys[:4])
        with pytest.raises(StoreUnavailable):
            cc.put(late[:2], _values(late[:2]))


def _lease_granted_ttl(etcd: str, key: str) -> int:
    """The TTL the lease holding ``key`` was granted with (etcd's own view)."""
    kv = httpx.post(f"{etcd}/v3/kv/range",
                    json={"key": base64.b64encode(key.encode()).decode()}).json()["kvs"][0]
    lease = httpx.post(f"{etcd}/v3/lease/timetolive", json={"ID": kv["lease"]}).json()
    return int(lease["grantedTTL"])


def test_daemon_registration_value(etcd, start_daemon, cluster_name):
    d = start_daemon("--etcd", etcd, "--cluster", cluster_name, "--registration-ttl", "3")
    with EtcdClient(etcd) as ec:
        value = json.loads(ec.get(layout.store_key(cluster_name, d.node_id)))
        assert value["address"] == d.address
        assert value["capacity"]["memory"] == 64 << 20
        assert _lease_granted_ttl(etcd, layout.store_key(cluster_name, d.node_id)) == 3
        d.stop(signal.SIGTERM)  # a clean stop deregisters at once
        assert ec.get(layout.store_key(cluster_name, d.node_id)) is None


def test_errors_when_nothing_is_there(etcd, free_port, cluster_name):
    t0 = time.monotonic()
    with pytest.raises(StoreUnavailable, match="etcd"):
        ClusterClient(f"http://127.0.0.1:{free_port()}", cluster_name)
    assert time.monotonic() - t0 < 2.0
    with pytest.raises(ValueError, match="without '/'"):  # before etcd is asked anything
        ClusterClient(f"http://127.0.0.1:{free_port()}", "a/b")
    with kvstore.connect(etcd=etcd, cluster=cluster_name) as cc:
        client: kvstore.StoreClient = cc  # what the engine's connector is typed against
        assert isinstance(client, kvstore.StoreClient) and isinstance(cc, ClusterClient)
        with pytest.raises(StoreUnavailable, match="no store nodes are registered"):
            cc.get_bytes(_keys("x", 1))
        assert cc.get_bytes([]) == [] and cc.prefix_len([]) == 0
        with pytest.raises(ValueError):
            cc.put(_keys("x", 2), [b"a"])
