"""The daemon under hostile or careless clients: nothing allocated before
authentication, no client flushing or holding the cache, file descriptors and threads
bounded, timeouts. Real daemons, raw sockets."""

from __future__ import annotations

import os
import resource
import socket
import threading
import time
import urllib.request

import pytest

from kvstore import AuthError, Client, ProtocolError, StoreFull, StoreUnavailable
from kvstore.keys import BlockKey
from kvstore.net import protocol as P
from tests.kvstore.test_bad_input import closed, expect_error, port_of, raw, read_frame

pytestmark = pytest.mark.integration

MiB = 1 << 20


def proc_status(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/status") as f:
        return dict(line.split(":", 1) for line in f if ":" in line)


def rss_anon(pid: int) -> int:
    """Anonymous resident bytes (the heap; not the shared-memory arena)."""
    return int(proc_status(pid)["RssAnon"].split()[0]) * 1024


def threads(pid: int) -> int:
    return int(proc_status(pid)["Threads"])


def wait_for(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def connections(c: Client) -> int:
    return c.stats()["server"]["connections"]


def metric(d, name: str) -> float:
    """The sum of a metric's samples on the daemon's /metrics (open without the secret)."""
    text = urllib.request.urlopen(f"http://{d.metrics}/metrics", timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def test_an_unauthenticated_peer_gets_no_memory_and_no_information(start_daemon):
    d = start_daemon("--cluster-secret", "s3cret", "--metrics-port", "0")
    pid = d.proc.pid
    with Client(d.address, auth_token="s3cret") as good:
        base = rss_anon(pid)
        held = []
        for _ in range(30):  # headers that claim 16 MiB of meta: refused from the header alone
            s = raw(d, authed=False)
            s.sendall(P.pack_header(P.Op.HELLO, 0, 1, 16 * MiB))
            held.append(s)
        for _ in range(30):  # ... and a STATS before HELLO
            s = raw(d, authed=False)
            s.sendall(P.pack_header(P.Op.STATS, 0, 1, 16 * MiB - 1))
            held.append(s)
        for s in held:
            err = expect_error(s, ProtocolError, "limit")
            assert closed(s), err
        waiting = []
        for _ in range(30):  # the largest HELLO allowed, its meta never sent: held, cheaply
            s = raw(d, authed=False)
            s.sendall(P.pack_header(P.Op.HELLO, 0, 1, P.MAX_HELLO_META) + b"{")
            waiting.append(s)
        wait_for(lambda: connections(good) == 31, 5, "the daemon did not take the connections")
        assert rss_anon(pid) - base < 8 * MiB
        with raw(d, authed=False) as s:  # a wrong secret learns nothing: no node id, no arena
            meta = P.pack_json({"token": "guess", "host_id": "x", "pid": 0})
            s.sendall(P.pack_header(P.Op.HELLO, 0, 1, len(meta)) + meta)
            err = expect_error(s, AuthError, "auth token")
            assert d.node_id not in str(err) and d.arena not in str(err)
            assert closed(s)
        for s in waiting:
            s.close()
        assert good.stats()["server"]["node_id"] == d.node_id
    assert metric(d, "kvstore_connections") >= 0  # /metrics stays open without the secret


def test_one_client_can_neither_flush_nor_hold_the_cache(start_daemon):
    d = start_daemon("--frame-timeout", "1", memory="16M")
    with Client(d.address, transport="tcp") as good:
        assert good._connection().hello["max_data"] == 4 * MiB  # 25% of the arena
        keys = [BlockKey(os.urandom(16)) for _ in range(100)]
        good.put(keys, [os.urandom(64 << 10)] * 100)
        base = good.stats()["store"]["host"]["allocated_bytes"]
        with raw(d) as s:  # a PUT the size of the arena, no payload: refused, nothing evicted
            meta = P.pack_keys_sizes([BlockKey(os.urandom(16))], [16 * MiB])
            s.sendall(P.pack_header(P.Op.PUT, 0, 2, len(meta), 16 * MiB) + meta)
            expect_error(s, StoreFull, "cap")
        assert all(good.contains(keys))
        with raw(d) as s:  # a PUT under the cap whose payload trickles: cut off at the deadline
            meta = P.pack_keys_sizes([BlockKey(os.urandom(16))], [3 * MiB])
            s.sendall(P.pack_header(P.Op.PUT, 0, 2, len(meta), 3 * MiB) + meta)
            t0 = time.monotonic()
            while not closed_nowait(s):
                assert time.monotonic() - t0 < 5, "a trickling PUT was not cut off"
                s.sendall(b"x" * 64)
                time.sleep(0.2)
        wait_for(lambda: good.stats()["store"]["host"]["allocated_bytes"] == base, 5,
                 "the trickling PUT's reservation was not released")
        assert all(good.contains(keys))
        big = [BlockKey(os.urandom(16)) for _ in range(6)]
        good.put(big, [os.urandom(MiB)] * 6)  # over max_data: the client splits it
        assert all(good.contains(big))


def closed_nowait(s: socket.socket) -> bool:
    try:
        return s.recv(1 << 16, socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def test_accepting_survives_running_out_of_file_descriptors(start_daemon):
    d = start_daemon("--metrics-port", "0", nofile=64)
    socks, refused = [], 0
    for _ in range(100):
        s = raw(d, authed=False)
        meta = P.pack_json({"token": None, "host_id": "x", "pid": 0})
        s.sendall(P.pack_header(P.Op.HELLO, 0, 1, len(meta)) + meta)
        socks.append(s)
    for s in socks:
        frame = read_frame(s)
        if frame is None or frame[0].flags & P.FLAG_ERROR:
            refused += 1
            if frame is not None:
                assert isinstance(P.error_from_meta(frame[1]), StoreUnavailable)
    assert 0 < refused < 100
    for s in socks:
        s.close()
    assert metric(d, "kvstore_accept_errors_total") > 0
    with Client(d.address, timeout=3) as c:  # still accepting once descriptors are free
        wait_for(lambda: connections(c) == 1, 5, "the refused connections were not closed")


def test_connection_limit_and_hello_and_idle_timeouts(start_daemon):
    d = start_daemon("--max-connections", "3", "--hello-timeout", "0.3", "--idle-timeout", "1",
                     "--metrics-port", "0")
    silent = raw(d, authed=False)  # never says HELLO: dropped after 0.3 s
    idle = raw(d)  # says HELLO, then nothing: dropped after 1 s
    good = Client(d.address)
    with pytest.raises(StoreUnavailable, match="at most 3 connections"):
        Client(d.address)
    t0 = time.monotonic()
    assert closed(silent)
    assert time.monotonic() - t0 < 2
    assert closed(idle)
    assert metric(d, 'kvstore_connections_dropped_total{reason="limit"}') == 1
    assert metric(d, 'kvstore_connections_dropped_total{reason="hello_timeout"}') == 1
    assert metric(d, 'kvstore_connections_dropped_total{reason="idle_timeout"}') >= 1
    good.close()


def test_idle_connections_hold_no_threads(start_daemon):
    n = 2000
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < n + 200:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, n + 500), hard))
    d = start_daemon()
    pid = d.proc.pid
    with Client(d.address) as good:
        good.put([BlockKey(b"k" * 16)], [b"v" * 1000])
        base_threads, base_rss = threads(pid), rss_anon(pid)
        socks = []
        try:
            meta = P.pack_json({"token": None, "host_id": "x", "pid": 0})
            hello = P.pack_header(P.Op.HELLO, 0, 1, len(meta)) + meta
            for _ in range(n):
                s = socket.create_connection(("127.0.0.1", port_of(d)), timeout=10)
                s.sendall(hello)
                socks.append(s)
            for s in socks:
                h, _ = read_frame(s)
                assert not h.flags & P.FLAG_ERROR
            assert connections(good) == n + 1
            assert threads(pid) <= base_threads + 40
            assert rss_anon(pid) - base_rss < 64 * MiB
            assert good.get_bytes([BlockKey(b"k" * 16)]) == [b"v" * 1000]
        finally:
            for s in socks:
                s.close()


def test_a_client_finds_the_cluster_secret_in_its_environment(start_daemon, tmp_path, monkeypatch):
    path = tmp_path / "secret"
    path.write_text("from-a-file\n")
    d = start_daemon("--host", "0.0.0.0", "--cluster-secret-file", str(path))
    address = f"127.0.0.1:{port_of(d)}"
    monkeypatch.delenv("KVSTORE_AUTH_TOKEN", raising=False)
    monkeypatch.delenv("KVCACHE_CLUSTER_SECRET_FILE", raising=False)
    monkeypatch.delenv("KVCACHE_CLUSTER_SECRET", raising=False)
    with pytest.raises(AuthError):
        Client(address)
    monkeypatch.setenv("KVCACHE_CLUSTER_SECRET", "from-a-file")
    with Client(address) as c:
        assert c.stats()["server"]["node_id"] == d.node_id
    monkeypatch.delenv("KVCACHE_CLUSTER_SECRET")
    monkeypatch.setenv("KVCACHE_CLUSTER_SECRET_FILE", str(path))
    Client(address).close()


def test_concurrent_clients_are_served_in_parallel(start_daemon):
    """More active clients than a single serving thread: all of them progress."""
    d = start_daemon("--threads", "4")
    errors: list[BaseException] = []

    def work() -> None:
        try:
            with Client(d.address, transport="tcp") as c:
                for _ in range(20):
                    k = [BlockKey(os.urandom(16)) for _ in range(4)]
                    c.put(k, [os.urandom(4096)] * 4)
                    assert all(c.get_bytes(k))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    ts = [threading.Thread(target=work) for _ in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    assert not errors, errors
