"""The address a store daemon registers (kvstore/net/address.py, ``--advertise-address``):
the one other hosts reach it at, never a wildcard."""

from __future__ import annotations

import json

import pytest

from kvstore.coord import layout
from kvstore.coord.etcd import EtcdClient
from kvstore.daemon.config import ServerConfig
from kvstore.net.address import advertised_host, is_wildcard, join_host_port, primary_address


def _registered(etcd: str, cluster: str, node_id: str) -> str:
    with EtcdClient(etcd) as c:
        value = c.get(layout.store_key(cluster, node_id))
    assert value is not None
    return json.loads(value)["address"]


def test_a_daemon_on_a_wildcard_registers_its_advertise_address(start_daemon, etcd, unique_prefix):
    cluster = unique_prefix.strip("/")
    d = start_daemon("--host", "0.0.0.0", "--insecure", "--etcd", etcd, "--cluster", cluster,
                     "--advertise-address", "192.0.2.7")  # only registered, never dialled
    port = d.address.rsplit(":", 1)[1]
    assert d.address == f"192.0.2.7:{port}"  # the ready line reports it too
    assert _registered(etcd, cluster, d.node_id) == f"192.0.2.7:{port}"


def test_by_default_a_wildcard_daemon_registers_the_primary_address(start_daemon, etcd,
                                                                   unique_prefix):
    cluster = unique_prefix.strip("/")
    d = start_daemon("--host", "0.0.0.0", "--insecure", "--etcd", etcd, "--cluster", cluster)
    port = d.address.rsplit(":", 1)[1]
    assert _registered(etcd, cluster, d.node_id) == d.address == f"{primary_address()}:{port}"
    d2 = start_daemon("--etcd", etcd, "--cluster", cluster)  # bound to 127.0.0.1: that
    assert _registered(etcd, cluster, d2.node_id) == d2.address.replace("localhost", "127.0.0.1")


def test_the_advertised_host_rules():
    assert advertised_host("10.1.2.3") == "10.1.2.3"
    assert advertised_host("0.0.0.0", "10.9.9.9") == "10.9.9.9"
    assert advertised_host("127.0.0.1", "10.9.9.9") == "10.9.9.9"
    assert not is_wildcard(advertised_host("0.0.0.0")) and not is_wildcard(advertised_host("::"))
    assert [is_wildcard(h) for h in ("0.0.0.0", "::", "[::]", "", "10.0.0.1")] == [True] * 4 + [False]
    assert join_host_port("::1", 7) == "[::1]:7" and join_host_port("h", 7) == "h:7"


def test_advertise_address_is_validated():
    with pytest.raises(ValueError, match="not both"):
        ServerConfig(memory_bytes=1 << 20, advertise="h:1", advertise_address="h")
    with pytest.raises(ValueError, match="others reach"):
        ServerConfig(memory_bytes=1 << 20, advertise_address="0.0.0.0")
