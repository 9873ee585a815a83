"""The etcd key layout: where each kind of process registers. This docstring is the spec.

::

    /{cluster}/stores/{node_id}      a store daemon   (kvstore serve; kvstore.daemon.cli)
    /{cluster}/workers/{worker_id}   an engine worker (kvengine serve; engine.worker.cli)
    /{cluster}/routers/{router_id}   a router         (kvrouter serve; router.server_main)
    /{cluster}/config/{name}         cluster settings, no lease (kvstore config; kvstore.coord.settings)
    /{cluster}/drain/{node_id}       a drain request and its progress (kvstore drain; kvstore.daemon.drain)

- Each member value is one JSON object, put under a lease by ``kvstore.coord.registration``;
  the fields of each kind are in docs/architecture.md ("etcd layout").
- ``config/store`` is the store's settings, one JSON object read and watched by every
  ``ClusterClient`` and store daemon: ``{"replicas": R}`` (absent: R = 1). Written only by
  ``kvstore config set`` and by ``kvstore serve --replicas`` when it is absent.
- ``drain/{node_id}``: ``{"state": "requested" | "draining" | "done" | "failed", ...}``, put by
  ``kvstore drain`` (requested) and then by the node itself; no lease, so a request waits
  for a node that is restarting.
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
    "STORE_CONFIG",
    "config_prefix",
    "config_key",
    "drain_prefix",
    "drain_key",
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


STORE_CONFIG = "store"
"""The name of the store's settings under ``config/`` (``{"replicas": R}``)."""


def config_prefix(cluster: str) -> str:
    """``/{cluster}/config/``: every cluster setting (watch this range)."""
    return f"/{_segment('cluster name', cluster)}/config/"


def config_key(cluster: str, name: str = STORE_CONFIG) -> str:
    return config_prefix(cluster) + _segment("config name", name)


def drain_prefix(cluster: str) -> str:
    """``/{cluster}/drain/``: drain requests, one key per node being drained."""
    return f"/{_segment('cluster name', cluster)}/drain/"


def drain_key(cluster: str, node_id: str) -> str:
    return drain_prefix(cluster) + _segment("store id", node_id)
