"""Replication over real daemons and a real etcd: R from etcd, copies restored after a node dies
and after one joins (each missing copy pushed once), read repair, hottest-first order."""

from __future__ import annotations

import signal
import time
import uuid

import httpx
import numpy as np
import pytest

from kvstore.client.cluster import ClusterClient
from kvstore.client.node import Client
from kvstore.client.placement import Placement
from kvstore.coord import settings
from kvstore.coord.etcd import EtcdClient
from kvstore.keys import block_keys, namespace_id
from kvstore.node.store import BlockStore, StoreConfig

pytestmark = pytest.mark.integration

BLOCK = 1024
TTL = "1"  # --registration-ttl: a killed node leaves etcd within ~1.5 s


def keys_of(tag: str, n: int) -> list[bytes]:
    ns = namespace_id({"test": "replication", "tag": tag, "run": uuid.uuid4().hex})
    return block_keys(ns, np.arange(n * 4, dtype=np.uint32), block_size=4)


def values_of(keys) -> list[bytes]:
    return [bytes(k) * (BLOCK // 16) for k in keys]


def poll(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.05)


def holders(daemons, keys) -> list[set[str]]:
    """Per key, the ids of the daemons that hold it (asked directly, over TCP)."""
    out: list[set[str]] = [set() for _ in keys]
    for d in daemons:
        with Client(d.address, transport="tcp") as c:
            for i, present in enumerate(c.contains(keys)):
                if present:
                    out[i].add(d.node_id)
    return out


def repair_pushes(d) -> float:
    """The daemon's kvstore_repair_blocks_total, from its /metrics."""
    text = httpx.get(f"http://{d.metrics}/metrics", timeout=5).text
    for line in text.splitlines():
        if line.startswith("kvstore_repair_blocks_total "):
            return float(line.split()[1])
    raise AssertionError("kvstore_repair_blocks_total is not exported")


@pytest.fixture
def cluster(etcd, start_daemon):
    """(name, start(*extra)): daemons of a fresh cluster with short TTLs and quick repairs."""
    name = f"r{uuid.uuid4().hex[:8]}"

    def start(*extra: str):
        return start_daemon("--etcd", etcd, "--cluster", name, "--registration-ttl", TTL,
                            "--repair-settle", "0.2", "--metrics-port", "0", *extra)

    return name, start


def set_replicas(etcd: str, name: str, r: int) -> None:
    with EtcdClient(etcd) as ec:
        settings.update(ec, name, replicas=r)


def test_r_copies_restored_after_a_node_dies(etcd, cluster):
    name, start = cluster
    set_replicas(etcd, name, 2)
    daemons = [start() for _ in range(3)]
    with ClusterClient(etcd, name, read_repair=False) as cc:
        assert cc.wait_for_nodes(3, 10.0) and cc.replicas == 2
        keys = keys_of("dies", 150)
        cc.put(keys, values_of(keys))
        placement = Placement(d.node_id for d in daemons)
        assert holders(daemons, keys) == [set(placement.owners(k, 2)) for k in keys]

        victim, survivors = daemons[0], daemons[1:]
        lost = [k for k, h in zip(keys, holders(daemons, keys)) if victim.node_id in h]
        victim.stop(signal.SIGKILL)
        # Right after the kill, the victim's keys have one copy left.
        assert all(len(h) == 1 for h in holders(survivors, lost)) and len(lost) > 60
        poll(lambda: all(len(h) == 2 for h in holders(survivors, keys)), 10.0,
             "every key back on 2 nodes")
        assert cc.get_bytes(keys) == values_of(keys)
        # Each lost copy was pushed once (by the survivor that still had it).
        assert sum(repair_pushes(d) for d in survivors) == len(lost)


def test_a_joining_node_gets_its_copies_each_pushed_once(etcd, cluster):
    name, start = cluster
    set_replicas(etcd, name, 2)
    old = [start() for _ in range(2)]
    with ClusterClient(etcd, name, read_repair=False) as cc:
        assert cc.wait_for_nodes(2, 10.0)
        keys = keys_of("join", 150)
        cc.put(keys, values_of(keys))
        assert all(len(h) == 2 for h in holders(old, keys))
        new = start()
        assert cc.wait_for_nodes(3, 10.0)
        placement = Placement(d.node_id for d in old + [new])
        owed = [new.node_id in placement.owners(k, 2) for k in keys]
        assert 50 < sum(owed) < 150
        poll(lambda: [new.node_id in h for h in holders([new], keys)] == owed, 10.0,
             "the new node to hold exactly the keys it now owns")
        # Both old nodes hold every key; only the highest-ranked holder pushed each one.
        time.sleep(0.5)  # any duplicate push would have landed by now
        assert sum(repair_pushes(d) for d in old) == sum(owed)
        assert repair_pushes(new) == 0


def test_read_repair_writes_back_to_the_targets_that_missed(etcd, cluster):
    name, start = cluster
    set_replicas(etcd, name, 2)
    a, b = start("--repair-rate", "0"), start("--repair-rate", "0")  # no background passes
    by_id = {a.node_id: a, b.node_id: b}
    with ClusterClient(etcd, name) as cc:
        assert cc.wait_for_nodes(2, 10.0) and cc.replicas == 2
        keys = keys_of("rr", 120)
        placement = Placement(by_id)
        first = {k: placement.ranking(k)[0] for k in keys}
        second = {k: placement.ranking(k)[1] for k in keys}
        # Each block only on its second-ranked node: its first owner lacks it.
        for node, d in by_id.items():
            with Client(d.address, transport="tcp") as c:
                mine = [k for k in keys if second[k] == node]
                c.put(mine, values_of(mine))
        read_bytes, read_into, unread = keys[:40], keys[40:80], keys[80:]
        assert cc.get_bytes(read_bytes) == values_of(read_bytes)
        bufs = [bytearray(BLOCK) for _ in read_into]
        assert cc.get(read_into, bufs) == [True] * len(read_into)
        assert [bytes(x) for x in bufs] == values_of(read_into)
        assert cc.read_repair is not None and cc.read_repair.wait_idle(10.0)
        h = holders([a, b], keys)
        assert all(h[i] == {first[k], second[k]} for i, k in enumerate(keys[:80]))
        assert all(h[80 + i] == {second[k]} for i, k in enumerate(unread))
        counts = cc.stats()["read_repair"]
        assert counts["written"] == 80 and counts["dropped"] == 0 and counts["failed"] == 0
        # A hit on the first target repairs nothing.
        assert cc.get_bytes(keys[:80]) == values_of(keys[:80])
        assert cc.read_repair.wait_idle(10.0) and cc.read_repair.counts()["written"] == 80

        # The per-node handles another component builds on.
        assert cc.local_node_id in by_id  # every daemon runs on this host
        client = cc.node_client(a.node_id)
        assert client is not None and client.node_id == a.node_id
        assert client.transport == "shm"
        assert cc.node_client("no-such-node") is None


def test_held_keys_are_hottest_first(tmp_path):
    with BlockStore(StoreConfig(memory_bytes=1 << 20, ssd_path=str(tmp_path / "ssd"))) as store:
        keys = keys_of("hot", 4)
        for k in keys:
            store.put(k, bytes(BLOCK))
        assert store.held_keys() == keys[::-1]  # the last written is the most recent
        assert store.get(keys[1]) is not None
        assert store.held_keys() == [keys[1], keys[3], keys[2], keys[0]]
        assert store.copy_out(keys[2]) == bytes(BLOCK)
        assert store.copy_out(keys_of("absent", 1)[0]) is None
