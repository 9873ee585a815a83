"""Registration and Membership against a real etcd (TTL 1 s so expiry tests stay short)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from kvstore.coord import layout
from kvstore.coord.etcd import EtcdClient, EtcdUnavailable
from kvstore.coord.membership import Membership, MembershipChange
from kvstore.coord.registration import Registration

pytestmark = pytest.mark.integration


def _wait(cond, timeout: float, what: str) -> float:
    """Poll ``cond`` until true; returns the seconds it took."""
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.05)
    return time.monotonic() - t0


def test_registration_puts_renews_and_revokes(etcd, unique_prefix):
    key = layout.store_key(unique_prefix.strip("/"), "n1")
    with EtcdClient(etcd) as c:
        reg = Registration(c, key, {"address": "127.0.0.1:1"}, ttl=1.0).start()
        try:
            assert json.loads(c.get(key)) == {"address": "127.0.0.1:1"}
            time.sleep(2.5)  # > 2 TTLs: only the keepalive thread keeps it there
            assert c.get(key) is not None and reg.registered
            reg.update({"address": "127.0.0.1:2"})
            assert json.loads(c.get(key)) == {"address": "127.0.0.1:2"}
        finally:
            reg.close()
        assert c.get(key) is None  # revoked at once, not after the TTL


def test_registration_recovers_a_lost_lease(etcd, unique_prefix):
    key = layout.store_key(unique_prefix.strip("/"), "n1")
    with EtcdClient(etcd) as c, Registration(c, key, {"a": 1}, ttl=1.0) as reg:
        first = reg.lease_id
        c.lease_revoke(first)  # as if etcd forgot it (restart with fresh data, long partition)
        assert c.get(key) is None
        _wait(lambda: c.get(key) is not None, 3.0, "re-registration")
        assert reg.lease_id != first and json.loads(c.get(key)) == {"a": 1}


def test_registration_start_fails_fast_without_etcd(free_port):
    reg = Registration(f"127.0.0.1:{free_port()}", layout.store_key("x", "n"), {}, ttl=1.0)
    with pytest.raises(EtcdUnavailable):
        reg.start()
    reg.close()


REGISTER_AND_HANG = """
import sys, time
from kvstore.coord.registration import Registration
Registration(sys.argv[1], sys.argv[2], {"pid": 1}, ttl=1.0).start()
print("ready", flush=True)
time.sleep(60)
"""


def test_registration_expires_after_sigkill(etcd, unique_prefix):
    key = layout.worker_key(unique_prefix.strip("/"), "w1")
    proc = subprocess.Popen(
        [sys.executable, "-c", REGISTER_AND_HANG, etcd, key], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        with EtcdClient(etcd) as c:
            assert c.get(key) is not None
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            took = _wait(lambda: c.get(key) is None, 4.0, "the lease to expire")
            assert took < 2.5  # TTL 1 s + etcd's 0.5 s expiry sweep + slack
    finally:
        proc.kill()
        proc.wait()


def test_membership_sees_joins_updates_and_leaves(etcd, unique_prefix):
    prefix = layout.stores_prefix(unique_prefix.strip("/"))
    changes: list[MembershipChange] = []
    with EtcdClient(etcd) as c:
        c.put(prefix + "a", json.dumps({"address": "A"}))
        c.put(prefix + "junk", b"not json")  # ignored, not fatal
        with Membership(c, prefix, on_change=changes.append) as m:
            assert m.members() == {"a": {"address": "A"}} and m.healthy
            with Registration(c, prefix + "b", {"address": "B"}, ttl=1.0):
                assert m.wait_for(lambda ms: "b" in ms, 3.0)
                c.put(prefix + "a", json.dumps({"address": "A2"}))
                assert m.wait_for(lambda ms: ms["a"] == {"address": "A2"}, 3.0)
            assert m.wait_for(lambda ms: "b" not in ms, 3.0)
            c.delete(prefix + "a")
            assert m.wait_for(lambda ms: ms == {}, 3.0)
    kinds = [
        (sorted(ch.joined), sorted(ch.updated), sorted(ch.left)) for ch in changes
    ]
    assert kinds == [
        (["a"], [], []),  # the initial read
        (["b"], [], []),
        ([], ["a"], []),
        ([], [], ["b"]),
        ([], [], ["a"]),
    ]
    assert changes[-1].members == {}


def test_membership_drops_a_killed_member_within_ttl(etcd, unique_prefix):
    prefix = layout.workers_prefix(unique_prefix.strip("/"))
    proc = subprocess.Popen(
        [sys.executable, "-c", REGISTER_AND_HANG, etcd, prefix + "w1"],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        with Membership(etcd, prefix) as m:
            assert "w1" in m.members()
            proc.kill()
            proc.wait()
            t0 = time.monotonic()
            assert m.wait_for(lambda ms: "w1" not in ms, 4.0)
            assert time.monotonic() - t0 < 2.5
    finally:
        proc.kill()
        proc.wait()


def test_membership_survives_etcd_restart(etcd_server):
    server = etcd_server()
    prefix = layout.stores_prefix("c")
    with EtcdClient(server.url) as c:
        c.put(prefix + "keep", json.dumps({"address": "K"}))
        with Membership(c, prefix, retry_interval=0.1, probe_interval=0.5) as m:
            assert m.healthy
            server.stop()
            assert m.wait_for(lambda _: not m.healthy, 5.0)
            assert isinstance(m.last_error, EtcdUnavailable)
            assert m.members() == {"keep": {"address": "K"}}  # last known view kept
            server.start()
            assert m.wait_for(lambda _: m.healthy, 10.0)
            c.put(prefix + "new", json.dumps({"address": "N"}))  # the watch works again
            assert m.wait_for(lambda ms: set(ms) == {"keep", "new"}, 5.0)
            assert m.last_error is None


def test_membership_resyncs_changes_missed_while_etcd_was_down(etcd_server):
    """Changes made while the watcher was cut off arrive as one resync diff on reconnect."""
    server = etcd_server()
    prefix = layout.stores_prefix("c")
    changes: list[MembershipChange] = []
    with EtcdClient(server.url) as writer:
        writer.put(prefix + "old", json.dumps({"address": "O"}))
        # A long retry interval: etcd is back and changed before the watcher retries.
        m = Membership(server.url, prefix, changes.append, retry_interval=3.0).start()
        try:
            server.stop()
            assert m.wait_for(lambda _: not m.healthy, 5.0)
            server.start()
            writer.delete(prefix + "old")
            writer.put(prefix + "fresh", json.dumps({"address": "F"}))
            assert m.wait_for(lambda ms: set(ms) == {"fresh"}, 10.0)
        finally:
            m.close()
    assert changes[-1].left == {"old": {"address": "O"}}
    assert changes[-1].joined == {"fresh": {"address": "F"}}
