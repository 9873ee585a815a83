"""The registration helper (kvstore/coord/registration.py) without an etcd: what it puts where,
and that deregistering never raises. The etcd-backed lifecycle is in test_membership.py."""

from __future__ import annotations

import json

import pytest

from kvstore.coord.etcd import EtcdClient, EtcdUnavailable
from kvstore.coord.registration import DEFAULT_TTL, Registration, register
from kvstore.daemon.config import ServerConfig


class FakeEtcd(EtcdClient):
    """Records puts and revokes; ``revoke_error`` is raised by lease_revoke."""

    def __init__(self, revoke_error: Exception | None = None) -> None:
        super().__init__("http://127.0.0.1:1")
        self.puts: list[tuple[str, bytes, int | None]] = []
        self.revoked: list[int] = []
        self.revoke_error = revoke_error

    def lease_grant(self, ttl: int) -> int:
        self.granted_ttl = ttl
        return 42

    def put(self, key, value, lease=None) -> int:
        self.puts.append((key, value, lease))
        return 1

    def lease_keepalive(self, lease: int) -> int:
        return 5

    def lease_revoke(self, lease: int) -> None:
        if self.revoke_error is not None:
            raise self.revoke_error
        self.revoked.append(lease)


def test_register_puts_the_member_key_under_a_lease_and_close_revokes():
    etcd = FakeEtcd()
    reg = register(etcd, "kv", "workers", "w1", {"address": "http://h:1"}, ttl=2.5)
    try:
        assert reg.key == "/kv/workers/w1" and reg.registered
        assert etcd.puts == [("/kv/workers/w1", json.dumps({"address": "http://h:1"}).encode(), 42)]
        assert etcd.granted_ttl == 3  # whole seconds, rounded up
    finally:
        reg.close()
    assert etcd.revoked == [42]
    reg.close()  # idempotent
    assert etcd.revoked == [42]
    etcd.close()


def test_register_refuses_a_malformed_id_before_touching_etcd():
    etcd = FakeEtcd()
    with pytest.raises(ValueError):
        register(etcd, "kv", "stores", "a/b", {})
    assert etcd.puts == []
    etcd.close()


@pytest.mark.parametrize("error", [EtcdUnavailable("gone"), RuntimeError("unexpected")])
def test_close_never_raises(error, caplog):
    etcd = FakeEtcd(revoke_error=error)
    reg = Registration(etcd, "/kv/stores/n", {}, ttl=1.0).start()
    reg.close()  # a shutdown path goes on; the key expires with its lease
    assert "could not revoke the lease of /kv/stores/n" in caplog.text
    etcd.close()


def test_the_daemon_default_ttl_is_the_registration_default():
    assert ServerConfig(memory_bytes=1 << 20).registration_ttl == DEFAULT_TTL == 5.0
