"""EtcdClient against a real etcd: kv, prefix, leases, CAS, watch, failover, fast failure."""

from __future__ import annotations

import threading
import time

import pytest

from kvstore.coord.etcd import (
    EtcdClient,
    EtcdError,
    EtcdUnavailable,
    LeaseExpired,
    WatchCompacted,
    prefix_range_end,
)
from kvstore.errors import KVStoreError, StoreUnavailable

pytestmark = pytest.mark.integration


@pytest.fixture
def client(etcd):
    with EtcdClient(etcd) as c:
        yield c


def _dead_url(free_port) -> str:
    return f"http://127.0.0.1:{free_port()}"


def test_prefix_range_end():
    assert prefix_range_end("/a/") == b"/a0"
    assert prefix_range_end(b"a\xff") == b"b"
    assert prefix_range_end(b"") == b"\0"


def test_put_get_delete(client, unique_prefix):
    k = unique_prefix + "/k"
    assert client.get(k) is None
    rev = client.put(k, b"\x00\xffbinary")
    assert rev > 0
    assert client.get(k) == b"\x00\xffbinary"
    client.put(k, "text")
    assert client.get(k) == b"text"
    assert client.delete(k) == 1
    assert client.delete(k) == 0
    assert client.get(k) is None


def test_get_prefix_and_delete_prefix(client, unique_prefix):
    for i in range(5):
        client.put(f"{unique_prefix}/a/{i}", str(i))
    client.put(f"{unique_prefix}/b", "outside")
    kvs, rev = client.get_prefix(unique_prefix + "/a/")
    assert kvs == {f"{unique_prefix}/a/{i}": str(i).encode() for i in range(5)}
    assert 0 < rev <= client.ping()
    assert client.delete_prefix(unique_prefix + "/a/") == 5
    assert client.get_prefix(unique_prefix + "/a/")[0] == {}
    assert client.get(f"{unique_prefix}/b") == b"outside"


def test_compare_and_swap(client, unique_prefix):
    k = unique_prefix + "/cas"
    assert client.compare_and_swap(k, None, b"v1") is True
    assert client.compare_and_swap(k, None, b"other") is False  # exists now
    assert client.compare_and_swap(k, b"wrong", b"v2") is False
    assert client.get(k) == b"v1"
    assert client.compare_and_swap(k, b"v1", b"v2") is True
    assert client.get(k) == b"v2"


def test_cas_is_atomic_under_contention(client, unique_prefix):
    k = unique_prefix + "/race"
    wins = []

    def contend(i: int) -> None:
        if client.compare_and_swap(k, None, str(i)):
            wins.append(i)

    threads = [threading.Thread(target=contend, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(wins) == 1
    assert client.get(k) == str(wins[0]).encode()


def test_lease_ttl_expiry_and_keepalive(client, unique_prefix):
    short = client.lease_grant(1)
    kept = client.lease_grant(1)
    client.put(unique_prefix + "/short", b"x", lease=short)
    client.put(unique_prefix + "/kept", b"y", lease=kept)
    deadline = time.monotonic() + 5
    while client.get(unique_prefix + "/short") is not None:
        assert client.lease_keepalive(kept) >= 1
        assert time.monotonic() < deadline, "leased key outlived its TTL"
        time.sleep(0.2)
    assert client.get(unique_prefix + "/kept") == b"y"  # renewed all along
    with pytest.raises(LeaseExpired):
        client.lease_keepalive(short)
    with pytest.raises(LeaseExpired):
        client.put(unique_prefix + "/late", b"z", lease=short)
    client.lease_revoke(kept)
    assert client.get(unique_prefix + "/kept") is None  # revoke deletes at once
    client.lease_revoke(kept)  # revoking a gone lease is a no-op


def test_watch_sees_puts_and_deletes_in_order(client, unique_prefix):
    p = unique_prefix + "/w/"
    client.put(p + "before", b"0")
    _, rev = client.get_prefix(p)
    events = []
    with client.watch_prefix(p, rev + 1) as watch:
        client.put(p + "a", b"1")
        client.put(unique_prefix + "/elsewhere", b"ignored")
        client.put(p + "a", b"2")
        client.delete(p + "before")
        for ev in watch:
            events.append(ev)
            if len(events) == 3:
                break
    assert [(e.type, e.key, e.value) for e in events] == [
        ("put", p + "a", b"1"),
        ("put", p + "a", b"2"),
        ("delete", p + "before", b""),
    ]
    assert events[0].mod_revision < events[1].mod_revision < events[2].mod_revision


def test_watch_replays_from_start_revision(client, unique_prefix):
    p = unique_prefix + "/replay/"
    first = client.put(p + "x", b"1")
    client.put(p + "x", b"2")
    with client.watch_prefix(p, first) as watch:
        it = iter(watch)
        assert next(it).value == b"1"
        assert next(it).value == b"2"


def test_watch_close_from_another_thread_wakes_reader(client, unique_prefix):
    _, rev = client.get_prefix(unique_prefix)
    watch = client.watch_prefix(unique_prefix, rev + 1, probe_interval=30)
    done = threading.Event()
    errors = []

    def reader():
        try:
            for _ in watch:
                pass
        except Exception as exc:  # noqa: BLE001 - the test reports it
            errors.append(exc)
        done.set()

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    time.sleep(0.2)  # let it block in recv
    t0 = time.monotonic()
    watch.close()
    assert done.wait(2.0), "closing the watch did not wake its reader"
    assert time.monotonic() - t0 < 1.0
    assert errors == []


def test_watch_compacted_revision_raises(client, unique_prefix):
    import httpx

    k = unique_prefix + "/c"
    first = client.put(k, b"1")
    last = client.put(k, b"2")
    httpx.post(client.endpoints[0] + "/v3/kv/compaction", json={"revision": str(last)}).raise_for_status()
    with pytest.raises(WatchCompacted) as info:
        with client.watch_prefix(k, first) as watch:
            next(iter(watch))
    assert info.value.compact_revision >= last


def test_unreachable_etcd_fails_fast(free_port):
    with EtcdClient(_dead_url(free_port), timeout=5.0) as c:
        t0 = time.monotonic()
        with pytest.raises(EtcdUnavailable) as info:
            c.get("/x")
        assert time.monotonic() - t0 < 1.0
        assert "is etcd running" in str(info.value)
        # An unreachable etcd is a StoreUnavailable at the kvstore API edge.
        assert isinstance(info.value, StoreUnavailable) and isinstance(info.value, EtcdError)
        with pytest.raises(EtcdUnavailable):
            c.watch_prefix("/x", 1)


def test_failover_to_next_endpoint(etcd, free_port, unique_prefix):
    with EtcdClient([_dead_url(free_port), etcd]) as c:
        rev = c.put(unique_prefix + "/f", b"ok")
        assert c.get(unique_prefix + "/f") == b"ok"
        with c.watch_prefix(unique_prefix + "/", rev) as watch:
            assert next(iter(watch)).value == b"ok"


def test_watch_reports_etcd_death(etcd_server):
    server = etcd_server()
    with EtcdClient(server.url) as c:
        rev = c.put("/d/k", b"1")
        watch = c.watch_prefix("/d/", rev + 1, probe_interval=0.5)
        outcome = []

        def reader():
            try:
                for _ in watch:
                    pass
                outcome.append("ended quietly")
            except EtcdUnavailable as exc:
                outcome.append(exc)

        t = threading.Thread(target=reader, daemon=True)
        t.start()
        time.sleep(0.2)
        server.stop()
        t.join(5.0)
        assert outcome and isinstance(outcome[0], EtcdUnavailable), outcome


def test_bad_endpoints_rejected():
    with pytest.raises(ValueError):
        EtcdClient([])
    with pytest.raises(ValueError):
        EtcdClient("ftp://127.0.0.1:2379")  # https is served (tests/kvstore/test_tls.py)
    assert issubclass(EtcdError, KVStoreError)


def test_same_client_works_across_an_etcd_restart(etcd_server):
    server = etcd_server()
    with EtcdClient(server.url) as c:
        c.put("/r/k", b"before")  # leaves a pooled keep-alive connection behind
        server.stop()
        with pytest.raises(EtcdUnavailable):
            c.get("/r/k")
        server.start()
        assert c.get("/r/k") == b"before"  # data dir kept
        c.put("/r/k", b"after")
        assert c.get("/r/k") == b"after"
        server.restart()  # no failed call in between: the pooled connection is simply stale
        assert c.get("/r/k") == b"after"
