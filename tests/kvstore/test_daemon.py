"""The daemon process: SIGTERM, kill -9 and restart from SSD, metrics, etcd registration."""

import json
import os
import signal
import socket
import subprocess
import sys
import uuid

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvstore import Client
from kvstore.coord import layout
from kvstore.coord.etcd import EtcdClient
from kvstore.keys import BlockKey
from kvstore.net import protocol as P
from kvstore.net import sockio
from kvstore.net.host_id import local_host_id
from kvstore.node.arena import SHM_DIR

pytestmark = pytest.mark.integration

MiB = 1 << 20


def rand_keys(n):
    return [BlockKey(os.urandom(16)) for _ in range(n)]


def hello(sock):
    meta = P.pack_json({"token": None, "host_id": "remote", "pid": 0})
    sock.sendall(P.pack_header(P.Op.HELLO, 0, 1, len(meta)) + meta)
    return read_response(sock)


def read_response(sock):
    hdr = bytearray(P.HEADER_SIZE)
    sockio.recv_exact(sock, memoryview(hdr))
    h = P.unpack_header(hdr)
    meta = bytearray(h.meta_len)
    sockio.recv_exact(sock, memoryview(meta))
    return h, meta


def test_sigterm_finishes_the_in_flight_put_and_exits_zero(start_daemon, tmp_path):
    d = start_daemon("--ssd-path", str(tmp_path / "ssd"))
    keys = rand_keys(2)
    data = os.urandom(2 * MiB)
    with socket.create_connection(("127.0.0.1", int(d.address.rsplit(":", 1)[1])), timeout=10) as s:
        hello(s)
        meta = P.pack_keys_sizes(keys, [MiB, MiB])
        s.sendall(P.pack_header(P.Op.PUT, 0, 2, len(meta), len(data)) + meta + data[:MiB // 2])
        d.proc.send_signal(signal.SIGTERM)  # mid-frame: the daemon must finish this PUT
        s.sendall(data[MiB // 2:])
        h, status = read_response(s)
        assert not h.flags & P.FLAG_ERROR and bytes(status) == b"\x01\x01"
    assert d.stop() == 0
    assert "Traceback" not in d.stderr
    # LMDB was closed cleanly, and a new daemon on the same SSD data is the same node
    d2 = start_daemon("--ssd-path", str(tmp_path / "ssd"))
    assert d2.node_id == d.node_id


def test_kill9_then_restart_serves_every_block_that_reached_ssd(start_daemon, tmp_path):
    ssd = str(tmp_path / "ssd")
    d = start_daemon("--ssd-path", ssd, memory="8M")
    keys = rand_keys(24)
    vals = {k: os.urandom(MiB - 4096) for k in keys}
    with Client(d.address) as c:
        for i in range(0, 24, 4):
            c.put(keys[i:i + 4], [vals[k] for k in keys[i:i + 4]])
        on_ssd = c.stats()["store"]["ssd"]["blocks"]
    assert on_ssd >= 8  # 24 MiB through an 8 MiB arena: most went down to SSD
    d.stop(signal.SIGKILL)

    d2 = start_daemon("--ssd-path", ssd, memory="8M")
    assert d2.node_id == d.node_id
    with Client(d2.address) as c:
        found = 0
        for i in range(0, 24, 4):  # a few at a time: promotions must fit the small arena
            got = c.get_bytes(keys[i:i + 4])
            for k, v in zip(keys[i:i + 4], got):
                if v is not None:
                    assert v == vals[k]  # nothing half-written or misfiled is served
                    found += 1
        assert found >= on_ssd


def scrape(addr: str) -> dict[tuple[str, tuple], float]:
    text = httpx.get(f"http://{addr}/metrics", timeout=5).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_a_new_daemon_removes_the_arena_a_killed_one_left_and_no_live_one(start_daemon):
    live = start_daemon()
    victim = start_daemon()
    victim_path = os.path.join(SHM_DIR, victim.arena)
    victim.proc.send_signal(signal.SIGKILL)  # by hand: the fixture would clean up after itself
    victim.proc.wait()
    assert os.path.exists(victim_path)  # SIGKILL leaves it: nothing in the daemon runs
    with Client(live.address) as c:
        c.put(rand_keys(1), [b"x" * 4096])
    fresh = start_daemon()
    assert not os.path.exists(victim_path)
    assert os.path.exists(os.path.join(SHM_DIR, live.arena))
    assert os.path.exists(os.path.join(SHM_DIR, fresh.arena))
    with Client(live.address) as c:
        assert c.stats()["store"]["host"]["blocks"] == 1  # its arena untouched, still served
    assert live.stop() == 0 and not os.path.exists(os.path.join(SHM_DIR, live.arena))


def test_metrics_move_by_the_right_amounts(start_daemon):
    d = start_daemon("--metrics-port", "0")
    assert d.metrics
    m0 = scrape(d.metrics)
    keys, size = rand_keys(8), 100_000
    with Client(d.address, transport="tcp") as tcp, Client(d.address) as shm:
        tcp.put(keys, [os.urandom(size)] * 8)
        assert shm.get(keys + rand_keys(2), [bytearray(size)] * 10) == [True] * 8 + [False] * 2
        tcp.get_bytes(keys[:3])
    m1 = scrape(d.metrics)

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return m1.get(key, 0.0) - m0.get(key, 0.0)

    assert delta("kvstore_bytes_total", direction="in", path="tcp") == 8 * size
    assert delta("kvstore_bytes_total", direction="out", path="shm") == 8 * size
    assert delta("kvstore_bytes_total", direction="out", path="tcp") == 3 * size
    assert delta("kvstore_hits_total", tier="host") == 11
    assert delta("kvstore_misses_total", tier="host") == 2
    assert delta("kvstore_bytes_in_total", tier="host") == 8 * size
    assert delta("kvstore_puts_total") == 8
    assert m1[("kvstore_blocks", (("tier", "host"),))] == 8
    assert m1[("kvstore_used_bytes", (("tier", "host"),))] == 8 * size
    assert delta("kvstore_op_seconds_count", op="put") == 1
    assert delta("kvstore_op_seconds_count", op="pin") == 1
    assert delta("kvstore_op_seconds_count", op="get") == 1
    assert delta("kvstore_op_seconds_count", op="hello") == 2
    assert d.stop() == 0


def test_serve_registers_in_etcd_and_deregisters_on_sigterm(start_daemon, etcd):
    cluster = f"t{uuid.uuid4().hex[:8]}"
    d = start_daemon("--etcd", etcd, "--cluster", cluster, "--memory", "32M")
    client = EtcdClient(etcd)
    try:
        raw = client.get(layout.store_key(cluster, d.node_id))
        assert raw is not None
        value = json.loads(raw)
        assert value["address"] == d.address and value["tiers"] == ["host"]
        assert value["capacity"] == {"memory": 32 * MiB, "ssd": 0, "gpu": 0}
        assert value["host_id"] == local_host_id()
        assert d.stop() == 0
        assert client.get(layout.store_key(cluster, d.node_id)) is None  # revoked, not expired
    finally:
        client.close()


def test_a_damaged_ssd_tier_does_not_stop_the_daemon(start_daemon, tmp_path):
    from tests.kvstore.test_ssd_tier import damage

    ssd = tmp_path / "ssd"
    d = start_daemon("--ssd-path", str(ssd))
    assert d.stop() == 0
    damage(ssd)
    r = subprocess.run([sys.executable, "-m", "kvstore.daemon.cli", "serve", "--port", "0",
                        "--memory", "8M", "--ssd-path", str(ssd), "--on-corrupt-ssd", "fail"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode != 0
    d2 = start_daemon("--ssd-path", str(ssd))
    assert d2.node_id == d.node_id
    assert "moved it to" in d2.stderr and ".corrupt-" in d2.stderr
    with Client(d2.address) as c:
        assert c.stats()["store"]["ssd_moved_aside"] == 1
        c.put([BlockKey(os.urandom(16))], [b"fresh"])
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("ssd.corrupt-")]
