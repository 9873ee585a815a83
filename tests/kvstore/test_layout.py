"""The etcd key layout (kvstore/coord/layout.py): the spec's keys exactly, malformed parts refused."""

from __future__ import annotations

import pytest

from kvstore.coord import layout


def test_keys_and_prefixes_follow_the_spec():
    assert layout.store_key("kv", "ab12") == "/kv/stores/ab12"
    assert layout.worker_key("kv", "prefill-1") == "/kv/workers/prefill-1"
    assert layout.router_key("kv", "router-9") == "/kv/routers/router-9"
    assert layout.stores_prefix("kv") == "/kv/stores/"
    assert layout.workers_prefix("kv") == "/kv/workers/"
    assert layout.routers_prefix("kv") == "/kv/routers/"
    for kind in layout.KINDS:
        assert layout.key("kv", kind, "x") == layout.prefix("kv", kind) + "x"


@pytest.mark.parametrize("cluster, member", [("", "n"), ("a/b", "n"), ("kv", ""), ("kv", "n/1")])
def test_a_slash_or_empty_part_is_refused(cluster, member):
    with pytest.raises(ValueError, match="without '/'"):
        layout.store_key(cluster, member)


def test_an_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="kind must be one of"):
        layout.key("kv", "nodes", "n")  # type: ignore[arg-type]
