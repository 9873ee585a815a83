"""The UCX data path's guarantees (kvstore/net/ucx.py), against real daemons: nothing of UCX
before the cluster secret, a block being sent is never evicted, reservations die with the
connection, bad input closes that one connection, and the transport each side picks.
(The client API itself runs over UCX in test_client.py's transport-parametrized fixture.)"""

import os
import time

import numpy as np
import pytest

from kvstore import Client, ProtocolError, StoreUnavailable
from kvstore.keys import BlockKey
from kvstore.net import protocol as P
from kvstore.net import ucx
from kvstore.net.buffers import Sink
from kvstore.net.host_id import local_host_id
from tests.kvstore.test_bad_input import closed, raw, read_frame, wait_alone

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(ucx.available() is not None, reason=str(ucx.available()))]


def rand_keys(n: int) -> list[BlockKey]:
    return [BlockKey(os.urandom(16)) for _ in range(n)]


@pytest.fixture
def ucx_meta():
    w = ucx.Worker()
    yield P.pack_json({"address": w.address.hex(), "prefix": 7})
    w.close()


def test_nothing_of_ucx_before_the_secret(start_daemon, tmp_path, ucx_meta):
    secret = tmp_path / "secret"
    secret.write_text("s3cret\n")
    d = start_daemon("--ucx", "--cluster-secret-file", str(secret))
    s = raw(d, authed=False)  # the UCX op first: refused, and the connection closed
    meta = ucx_meta
    s.sendall(P.pack_header(P.Op.UCX, 0, 1, len(meta)) + meta)
    h, m = read_frame(s)
    assert h.flags & P.FLAG_ERROR and P.error_from_meta(m).__class__.__name__ == "AuthError"
    assert b"address" not in m and closed(s)
    s = raw(d, authed=False)  # a wrong secret: an AUTH error, nothing about UCX
    hello = P.pack_json({"token": "wrong", "host_id": "elsewhere", "pid": 0})
    s.sendall(P.pack_header(P.Op.HELLO, 0, 1, len(hello)) + hello)
    h, m = read_frame(s)
    assert h.flags & P.FLAG_ERROR and b"ucx" not in m and closed(s)
    s = raw(d, token="s3cret")  # the right one: the UCX op answers the daemon's worker
    s.sendall(P.pack_header(P.Op.UCX, 0, 2, len(meta)) + meta)
    h, m = read_frame(s)
    assert not h.flags & P.FLAG_ERROR
    assert len(bytes.fromhex(P.unpack_json(m)["address"])) > 16
    s.close()


def test_a_block_being_sent_is_not_evicted(start_daemon):
    """A GET over UCX whose client has not posted its receives yet keeps its block pinned
    while another client's puts evict everything else from the 16 MiB arena."""
    d = start_daemon("--ucx", memory="16M")
    key, value = rand_keys(1), np.random.default_rng(0).integers(0, 256, 3 << 20, dtype=np.uint8)
    with Client(d.address, transport="ucx") as reader, Client(d.address, transport="ucx") as filler:
        assert reader.put(key, [value]) == [True]
        conn = reader._connection()
        _, meta = conn.exchange(P.Op.GET, P.pack_keys(key), expect=8, flags=P.FLAG_UCX)
        assert P.unpack_sizes(meta) == [value.nbytes]
        rid = conn.rid
        for _ in range(4):  # 4 x 3 x 3 MiB through a 16 MiB arena
            filler.put(rand_keys(3), [np.ones(3 << 20, np.uint8)] * 3)
        assert filler.stats()["store"]["host"]["evictions"] > 0
        got = np.zeros_like(value)
        assert conn.ucx is not None
        ucx.wait(conn.ucx.ep.recv([got], [ucx.tag(conn.ucx.prefix, rid, 0)]), time.monotonic() + 5)
        assert np.array_equal(got, value)
        assert reader.get_bytes(key) == [value.tobytes()]  # and it is still there, unpinned


def test_a_client_that_hangs_up_mid_get_frees_its_session_at_once(ucx_daemon):
    """Its socket closed, its endpoint left open, its receives never posted: the daemon stops
    waiting for the rendezvous at the hang-up, not at the 30 s frame deadline, and unpins."""
    key = rand_keys(1)
    with Client(ucx_daemon.address, transport="tcp") as watcher:
        c = Client(ucx_daemon.address, transport="ucx")
        assert c.put(key, [np.ones(4 << 20, np.uint8)]) == [True]
        conn = c._connection()
        conn.exchange(P.Op.GET, P.pack_keys(key), expect=8, flags=P.FLAG_UCX)
        t0 = time.monotonic()
        conn.sock.close()
        wait_alone(watcher, timeout=10)
        assert time.monotonic() - t0 < 5
        assert watcher.delete(key) == 1  # unpinned: the delete frees it at once
        assert watcher.contains(key) == [False]
        assert conn.ucx is not None
        conn.ucx.close()
        c._conn = None
        c.close()


def test_ucx_clients_on_threads_each_closing_leaves_the_others_alone(ucx_daemon):
    """Four clients on four threads (four serving threads on one worker in the daemon) put and
    get at once, every byte right, while each closes when done (with one client worker for
    the process, a closing session's endpoint failed the others' transfers: ucx.Link)."""
    import threading

    errors: list[BaseException] = []

    def work(seed: int) -> None:
        try:
            rng = np.random.default_rng(seed)
            with Client(ucx_daemon.address, transport="ucx") as c:
                for _ in range(3):
                    keys = rand_keys(32)
                    vals = [rng.integers(0, 256, 64 << 10, dtype=np.uint8) for _ in keys]
                    assert c.put(keys, vals) == [True] * 32
                    bufs = [np.empty(64 << 10, np.uint8) for _ in keys]
                    assert c.get(keys, bufs) == [True] * 32
                    assert all(np.array_equal(a, b) for a, b in zip(bufs, vals))
                    assert c.delete(keys) == 32
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and not any(t.is_alive() for t in threads)


class OneLanding(Sink):
    """Lands a block in one array of its own (or, asked for no landing, consumes staging)."""

    def __init__(self, size: int, land: bool) -> None:
        super().__init__(np.zeros(size, np.uint8))
        self.target, self.land, self.got = np.zeros(size, np.uint8), land, b""

    def landing(self, size: int):
        return [self.target[:size]] if self.land else None

    def landed(self, size: int) -> None:
        self.got = b"landed:" + self.target[:size].tobytes()

    def consume(self, block) -> None:
        self.got = b"consumed:" + bytes(block)


def test_sinks_over_ucx_and_the_bytes_counted(ucx_daemon):
    keys, vals = rand_keys(2), [os.urandom(3000), os.urandom(20000)]
    with Client(ucx_daemon.address, transport="ucx") as c:
        before = c.stats()["server"]
        assert c.put(keys, vals) == [True, True]
        sinks = [OneLanding(20000, land=True), OneLanding(20000, land=False)]
        assert c.get(keys, sinks) == [True, True]
        assert sinks[0].got == b"landed:" + vals[0] and sinks[1].got == b"consumed:" + vals[1]
        assert c.bytes_sent + c.bytes_received < 4096  # the values never touched the socket
        assert before["ucx"] is True
        assert c.delete(keys) == 2


def allocated(c: Client) -> int:
    return c.stats()["store"]["host"]["allocated_bytes"]


def freed_to(c: Client, nbytes: int, timeout: float = 5.0) -> bool:
    """Whether the arena's allocation came back to ``nbytes`` within ``timeout`` (a session
    leaves the daemon's table before its release, which closes its UCX endpoint first)."""
    deadline = time.monotonic() + timeout
    while allocated(c) != nbytes:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_reservations_die_with_the_connection(start_daemon):
    d = start_daemon("--ucx")
    with Client(d.address, transport="tcp") as watcher:
        before = allocated(watcher)
        c = Client(d.address, transport="ucx")
        c._connection().exchange(P.Op.RESERVE, P.pack_keys_sizes(rand_keys(2), [4 << 20, 4 << 20]),
                                 expect=16, flags=P.FLAG_UCX)
        assert allocated(watcher) >= before + (8 << 20)
        c.close()  # its receives posted into the slots are cancelled, then the slots freed
        wait_alone(watcher)
        assert freed_to(watcher, before)


def test_values_that_never_come_fail_the_commit_and_free_their_slots(start_daemon):
    d = start_daemon("--ucx", "--frame-timeout", "0.3")
    with Client(d.address, transport="tcp") as watcher:
        before = allocated(watcher)
        c = Client(d.address, transport="ucx")
        keys = rand_keys(1)
        conn = c._connection()
        conn.exchange(P.Op.RESERVE, P.pack_keys_sizes(keys, [1 << 20]), expect=8, flags=P.FLAG_UCX)
        t0 = time.monotonic()
        with pytest.raises(ProtocolError, match="did not arrive"):
            conn.exchange(P.Op.COMMIT, P.pack_keys(keys), expect=0)
        assert time.monotonic() - t0 < 3
        c.close()
        wait_alone(watcher)
        assert freed_to(watcher, before) and watcher.contains(keys) == [False]


def test_bad_ucx_input_closes_that_one_connection(ucx_daemon):
    with Client(ucx_daemon.address, transport="ucx") as good:
        keys = rand_keys(1)
        good.put(keys, [b"v" * 5000])
        for op, meta, flags in (
                (P.Op.GET, P.pack_keys(keys), P.FLAG_UCX),  # no UCX set up on this connection
                (P.Op.CONTAINS, P.pack_keys(keys), P.FLAG_UCX),  # not an op that moves blocks
                (P.Op.UCX, b"{not json", 0),
                (P.Op.UCX, P.pack_json({"address": "zz", "prefix": 1}), 0),
                (P.Op.UCX, P.pack_json({"address": "00" * 64, "prefix": 1}), 0)):
            s = raw(ucx_daemon)
            s.sendall(P.pack_header(op, flags, 5, len(meta)) + meta)
            h, m = read_frame(s)
            assert h.flags & P.FLAG_ERROR and isinstance(P.error_from_meta(m), ProtocolError)
            assert closed(s)
            s.close()
        conn = good._connection()  # an ABORT of values expected over UCX: refused and closed
        k2 = rand_keys(1)
        conn.exchange(P.Op.RESERVE, P.pack_keys_sizes(k2, [100]), expect=8, flags=P.FLAG_UCX)
        with pytest.raises(ProtocolError, match="ABORT"):
            conn.exchange(P.Op.ABORT, P.pack_keys(k2), expect=0)
        good._drop()  # as Client does after a ProtocolError
        assert good.get_bytes(keys) == [b"v" * 5000]  # reconnected, the daemon serves on
        assert good.transport == "ucx"


def test_the_transport_each_side_picks(ucx_daemon, shared_daemon):
    with Client(ucx_daemon.address) as auto:
        assert auto.transport == "shm"  # same host: shared memory wins
    with Client(ucx_daemon.address, transport="tcp") as tcp:
        assert tcp.transport == "tcp"
    with pytest.raises(StoreUnavailable, match="does not serve UCX"):
        Client(shared_daemon.address, transport="ucx")
    with pytest.raises(ValueError, match="unencrypted"):
        Client(ucx_daemon.address, transport="ucx", tls=_fake_tls())


def test_auto_takes_ucx_off_the_arena_and_tcp_when_ucx_will_not_start(ucx_daemon, monkeypatch):
    from kvstore.net.connection import Connection

    monkeypatch.setattr(Connection, "_attach", lambda self, use_index: None)  # as on another host
    with Client(ucx_daemon.address) as c:
        assert c.transport == "ucx" and c.get_bytes(rand_keys(1)) == [None]

    def broken() -> None:
        raise RuntimeError("no UCX devices (test)")

    monkeypatch.setattr(ucx, "Worker", broken)
    with Client(ucx_daemon.address) as c:  # auto: falls back to TCP, with a warning
        assert c.transport == "tcp" and c.get_bytes(rand_keys(1)) == [None]
    with pytest.raises(StoreUnavailable, match="cannot set up UCX"):
        Client(ucx_daemon.address, transport="ucx")  # forced: says why


def _fake_tls():
    from kvstore.tls import TLSConfig

    return TLSConfig(cert="c", key="k", ca="a")


def test_a_cluster_client_picks_by_what_a_node_advertises(monkeypatch):
    from kvstore.client import transport as T

    here, there = local_host_id(), "0" * 32
    assert T.pick({"host_id": here, "transports": ["tcp", "shm"]}, "auto") == "auto"  # shm
    assert T.pick({"host_id": there, "transports": ["tcp", "shm", "ucx"]}, "auto") == "auto"  # ucx
    assert T.pick({"host_id": there, "transports": ["tcp", "shm"]}, "auto") == "tcp"
    assert T.pick({"host_id": there}, "auto") == "tcp"  # an older daemon's registration
    assert T.pick({"host_id": there, "transports": ["ucx"]}, "auto", tls=True) == "tcp"
    assert T.pick({"host_id": there}, "ucx") == "ucx"  # forced, whatever it advertises
    monkeypatch.setattr(ucx, "available", lambda: "ucxx is not importable (test)")
    assert T.pick({"host_id": there, "transports": ["ucx"]}, "auto") == "tcp"


def test_a_ucx_daemon_advertises_it_and_a_cluster_client_uses_it(start_daemon, etcd, unique_prefix):
    import json

    from kvstore.client.cluster import ClusterClient
    from kvstore.coord import layout
    from kvstore.coord.etcd import EtcdClient

    cluster = unique_prefix.strip("/")
    d = start_daemon("--ucx", "--etcd", etcd, "--cluster", cluster)
    plain = start_daemon("--etcd", etcd, "--cluster", cluster)
    with EtcdClient(etcd) as e:
        got = {n: json.loads(e.get(layout.store_key(cluster, n)) or "{}")["transports"]
               for n in (d.node_id, plain.node_id)}
    assert got == {d.node_id: ["tcp", "shm", "ucx"], plain.node_id: ["tcp", "shm"]}
    with ClusterClient(etcd, cluster, transport="ucx") as cc:
        assert cc.wait_for_nodes(2, 10)
        node = cc.node_client(d.node_id)
        assert node is not None and node.transport == "ucx"
    with ClusterClient(etcd, cluster) as cc:  # auto, one host: shared memory with both
        assert cc.wait_for_nodes(2, 10)
        assert {cc.node_client(n).transport for n in got} == {"shm"}  # type: ignore[union-attr]


def test_serve_flags(monkeypatch, capsys):
    from kvstore.daemon.cli import build_parser
    from kvstore.daemon.config import ServerConfig

    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    assert "--ucx" in capsys.readouterr().out
    assert build_parser().parse_args(["serve", "--ucx"]).ucx is True
    with pytest.raises(ValueError, match="unencrypted"):
        ServerConfig(memory_bytes=1 << 20, ucx=True, tls=_fake_tls())
    monkeypatch.setattr(ucx, "available", lambda: "ucxx is not importable (test)")
    with pytest.raises(ValueError, match="--ucx: ucxx is not importable"):
        ServerConfig(memory_bytes=1 << 20, ucx=True)
    assert ServerConfig(memory_bytes=1 << 20).ucx is False  # off by default
