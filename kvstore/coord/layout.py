"""The etcd key layout: where each kind of process registers. This docstring is the spec.

::

    /{cluster}/stores/{node_id}      a store daemon   (kvstore serve; kvstore.daemon.cli)
    /{cluster}/workers/{worker_id}   an engine worker (kvengine serve; engine.worker.cli)
    /{cluster}/routers/{router_id}   a router         (kvrouter serve; router.server_main)

- Each value is one JSON object, put under a lease by ``kvstore.coord.registration``; the
  fields of each kind are in docs/architecture.md ("etcd layout").
- A kind's members are the keys under its prefix (``prefix(cluster, kind)``, ending in
  ``/``); a member's id is its key with the prefix removed. ``Membership`` watches a prefix.
- ``cluster`` and ids are non-empty and contain no ``/``, so a key splits back into exactly
  one (cluster, kind, id); anything else is a ``ValueError`` here, before etcd is touched.

Build keys with these functions only; nothing else in the code base spells a key path.
"""

from __future__ import annotations

from typing import Literal, get_args

__all__ = [
    "Kind",
    "KINDS",
    "prefix",
    "key",
    "store_key",
    "worker_key",
    "router_key",
    "stores_prefix",
    "workers_prefix",
    "routers_prefix",
]

Kind = Literal["stores", "workers", "routers"]
KINDS: tuple[Kind, ...] = get_args(Kind)


def _segment(what: str, value: str) -> str:
    if not isinstance(value, str) or not value or "/" in value:
        raise ValueError(f"an etcd {what} must be a non-empty string without '/', got {value!r}")
    return value


def prefix(cluster: str, kind: Kind) -> str:
    """``/{cluster}/{kind}/``: every member of one kind (watch or read this range)."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    return f"/{_segment('cluster name', cluster)}/{kind}/"


def key(cluster: str, kind: Kind, member_id: str) -> str:
    """``/{cluster}/{kind}/{member_id}``: one member's key."""
    return prefix(cluster, kind) + _segment(f"{kind[:-1]} id", member_id)


def stores_prefix(cluster: str) -> str:
    return prefix(cluster, "stores")


def workers_prefix(cluster: str) -> str:
    return prefix(cluster, "workers")


def routers_prefix(cluster: str) -> str:
    return prefix(cluster, "routers")


def store_key(cluster: str, node_id: str) -> str:
    return key(cluster, "stores", node_id)


def worker_key(cluster: str, worker_id: str) -> str:
    return key(cluster, "workers", worker_id)


def router_key(cluster: str, router_id: str) -> str:
    return key(cluster, "routers", router_id)
