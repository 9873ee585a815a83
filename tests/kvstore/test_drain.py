"""Operator commands over real daemons and a real etcd: `kvstore drain` (blocks handed over, the
node leaves, no request fails meanwhile), `kvstore nodes`, `kvstore config`, `serve --replicas`,
and a node restarted on its SSD directory keeping its identity and its blocks."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import uuid

import pytest

from kvstore.client.cluster import ClusterClient
from kvstore.client.node import Client
from kvstore.client.placement import Placement
from kvstore.coord import layout, settings
from kvstore.coord.etcd import EtcdClient
from tests.kvstore.test_replication import holders, keys_of, poll, values_of
from tests.procs import REPO

pytestmark = pytest.mark.integration


def kvstore(*args: str, timeout: float = 30.0) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvstore.daemon.cli", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def name() -> str:
    return f"d{uuid.uuid4().hex[:8]}"


def test_drain_hands_blocks_over_and_leaves_with_no_request_failing(etcd, start_daemon, name):
    daemons = [start_daemon("--etcd", etcd, "--cluster", name, "--registration-ttl", "1",
                            "--repair-settle", "0.2") for _ in range(3)]
    victim, rest = daemons[0], daemons[1:]
    with ClusterClient(etcd, name) as cc:
        assert cc.wait_for_nodes(3, 10.0) and cc.replicas == 1
        keys = keys_of("drain", 150)
        cc.put(keys, values_of(keys))
        only_there = [k for k in keys if cc.owners(k) == [victim.node_id]]
        assert len(only_there) > 25

        stop, errors, misses, written = threading.Event(), [], [], []

        def load() -> None:  # reads of everything and new writes, all through the drain
            n = 0
            while not stop.is_set():
                try:
                    got = [g for i in range(0, len(keys), 4) for g in cc.get_bytes(keys[i:i + 4])]
                    misses.extend(k for k, v in zip(keys, got) if v is None)
                    new = keys_of(f"during{n}", 4)
                    cc.put(new, values_of(new))
                    written.extend(new)
                    n += 1
                except Exception as exc:  # noqa: BLE001 - any failure fails the test
                    errors.append(exc)

        thread = threading.Thread(target=load)
        thread.start()
        try:
            done = kvstore("drain", victim.node_id, "--etcd", etcd, "--cluster", name,
                           "--timeout", "20")
        finally:
            stop.set()
            thread.join()
        assert done.returncode == 0, done.stderr
        assert f"drained {victim.node_id}" in done.stdout
        assert victim.proc.wait(10) == 0
        assert f"kvstore drained node_id={victim.node_id}" in (victim.log_dir /
                                                               "stdout.log").read_text()
        assert errors == [] and misses == [] and len(written) > 0
        with EtcdClient(etcd) as ec:
            assert ec.get(layout.store_key(name, victim.node_id)) is None
            assert ec.get(layout.drain_key(name, victim.node_id)) is None  # the CLI cleaned up
        poll(lambda: victim.node_id not in cc.nodes, 3.0, "the client to see it leave")
        everything = keys + written
        survivors = Placement(d.node_id for d in rest)
        assert [survivors.owners(k)[0] in h for k, h in zip(everything, holders(rest, everything))] \
            == [True] * len(everything)
        assert cc.get_bytes(everything) == values_of(everything)
    # A node that is not registered is an error, not a wait.
    gone = kvstore("drain", victim.node_id, "--etcd", etcd, "--cluster", name)
    assert gone.returncode == 1 and "no store node" in gone.stderr


def test_nodes_lists_the_cluster_and_config_sets_replicas(etcd, start_daemon, name, tmp_path):
    # The first daemon seeds R; a later flag does not override what is set.
    a = start_daemon("--etcd", etcd, "--cluster", name, "--replicas", "3",
                     "--ssd-path", str(tmp_path / "ssd"), "--registration-ttl", "2")
    b = start_daemon("--etcd", etcd, "--cluster", name, "--registration-ttl", "2")
    with ClusterClient(etcd, name) as cc:
        assert cc.wait_for_nodes(2, 10.0) and cc.replicas == 3
        cc.put(keys_of("n", 5), values_of(keys_of("n", 5)))
        assert kvstore("config", "set", "replicas", "2", "--etcd", etcd, "--cluster",
                       name).returncode == 0
        poll(lambda: cc.replicas == 2, 3.0, "the client to follow the new R")
    with pytest.raises(ValueError, match=">= 1"):
        settings.validate("replicas", "0")  # `kvstore config set replicas 0`: exit 2
    c = start_daemon("--etcd", etcd, "--cluster", name, "--replicas", "3")
    assert json.loads(kvstore("config", "get", "--json", "--etcd", etcd, "--cluster",
                              name).stdout) == {"replicas": 2}

    listed = kvstore("nodes", "--json", "--etcd", etcd, "--cluster", name)
    assert listed.returncode == 0, listed.stderr
    table = json.loads(listed.stdout)
    assert table["replicas"] == 2
    rows = {r["node_id"]: r for r in table["nodes"]}
    assert rows.keys() == {a.node_id, b.node_id, c.node_id}
    assert rows[a.node_id]["address"] == a.address and rows[a.node_id]["state"] == "up"
    assert rows[a.node_id]["tiers"] == ["host", "ssd"] and rows[b.node_id]["tiers"] == ["host"]
    assert rows[a.node_id]["transports"] == ["tcp", "shm"]  # no --ucx
    host = rows[b.node_id]["occupancy"]["host"]
    assert host["capacity_bytes"] == 64 << 20
    assert sum(r["occupancy"]["host"]["blocks"] for r in rows.values()) >= 5

    b.stop(signal.SIGKILL)  # still registered until its lease expires: listed unreachable
    text = kvstore("nodes", "--etcd", etcd, "--cluster", name)
    assert text.returncode == 0, text.stderr
    lines = {ln.split()[0]: ln for ln in text.stdout.splitlines()[2:]}
    assert lines.keys() == {a.node_id, b.node_id, c.node_id}, text.stdout
    assert " up " in lines[a.node_id] and " unreachable " in lines[b.node_id]
    assert "replicas 2" in text.stdout.splitlines()[0]


def test_a_restarted_node_keeps_its_identity_and_serves_what_it_kept(etcd, start_daemon, name,
                                                                     tmp_path):
    ssd = str(tmp_path / "ssd")
    args = ("--etcd", etcd, "--cluster", name, "--ssd-path", ssd)
    d = start_daemon(*args, "--node-id", "store-a", memory="2M")
    assert d.node_id == "store-a"
    keys = keys_of("restart", 48)
    values = [bytes([i]) * (128 << 10) for i in range(len(keys))]  # 6 MiB through 2 MiB
    with Client(d.address, transport="tcp") as c:
        for i in range(0, len(keys), 4):
            c.put(keys[i:i + 4], values[i:i + 4])
        on_ssd = c.stats()["store"]["ssd"]["blocks"]
    assert on_ssd >= 24
    d.stop(signal.SIGKILL)

    # Without --node-id the kept id comes back; a different one is refused in one line.
    refused = kvstore("serve", "--port", "0", "--memory", "2M", "--ssd-path", ssd,
                      "--node-id", "store-b")
    assert refused.returncode == 2 and "conflicts with the id store-a" in refused.stderr
    d2 = start_daemon(*args, memory="2M")
    assert d2.node_id == "store-a"
    with EtcdClient(etcd) as ec:
        value = json.loads(ec.get(layout.store_key(name, "store-a")) or b"{}")
        assert value["address"] == d2.address
    with ClusterClient(etcd, name) as cc:
        assert cc.wait_for_nodes(1, 10.0) and cc.nodes == {"store-a": d2.address}
        got = [g for i in range(0, len(keys), 4) for g in cc.get_bytes(keys[i:i + 4])]
    kept = [g for g in got if g is not None]
    assert len(kept) >= on_ssd
    assert all(g == v for g, v in zip(got, values) if g is not None)
