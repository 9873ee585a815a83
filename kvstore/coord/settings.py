"""Cluster settings in etcd: the store's replica count and anything like it later.

Where: ``/{cluster}/config/store`` (``kvstore.coord.layout``), one JSON object with no lease
(a setting outlives every process)::

    {"replicas": 2}

- ``replicas`` (R, an int >= 1) is how many nodes hold each block: every ``ClusterClient``
  writes a key to the R highest-ranked live, non-draining nodes and reads up to R of them,
  and every store daemon's repair pass keeps R copies (``kvstore.daemon.repair``). It is read
  and watched, never passed per client, so writers, readers and repairers agree. Absent key
  or field: R = 1. A malformed value is logged and read as the default, never a crash.
- Written by ``kvstore config set replicas N`` (``update``: a compare-and-swap loop, so two
  operators setting different fields do not lose either) and by ``kvstore serve --replicas
  N``, which only *seeds* it (``seed``: create when absent; an existing value wins, with a
  warning when it differs), so a restarted daemon with an old flag never overrides what an
  operator set since.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from kvstore.coord import layout
from kvstore.coord.etcd import EtcdClient

__all__ = ["DEFAULT_REPLICAS", "SETTINGS", "replicas_of", "read", "update", "seed", "validate"]

log = logging.getLogger(__name__)

DEFAULT_REPLICAS = 1
SETTINGS = {"replicas": "copies of each block, on the highest-ranked live nodes (int >= 1)"}


def validate(name: str, value: Any) -> Any:
    """``value`` checked (and converted from text) for setting ``name``; ValueError if bad."""
    if name not in SETTINGS:
        raise ValueError(f"unknown setting {name!r}; known: {', '.join(SETTINGS)}")
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"replicas must be an integer >= 1, got {value!r}") from None
    if n < 1 or isinstance(value, bool):
        raise ValueError(f"replicas must be an integer >= 1, got {value!r}")
    return n


def replicas_of(config: Any) -> int:
    """R from a decoded ``config/store`` value (None or malformed: the default)."""
    if not isinstance(config, dict) or "replicas" not in config:
        return DEFAULT_REPLICAS
    try:
        return validate("replicas", config["replicas"])
    except ValueError as exc:
        log.warning("ignoring the store setting in etcd: %s; using replicas=%d", exc,
                    DEFAULT_REPLICAS)
        return DEFAULT_REPLICAS


def _decode(raw: bytes | None) -> dict[str, Any]:
    if raw is None:
        return {}
    try:
        value = json.loads(raw)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        log.warning("the store settings in etcd are not a JSON object; ignoring them")
        return {}
    return value


def read(etcd: EtcdClient, cluster: str) -> dict[str, Any]:
    """The stored settings (``{}`` when none were set)."""
    return _decode(etcd.get(layout.config_key(cluster)))


def update(etcd: EtcdClient, cluster: str, **values: Any) -> dict[str, Any]:
    """Set ``values`` (validated) in the stored settings, atomically; returns the new object."""
    checked = {name: validate(name, v) for name, v in values.items()}
    key = layout.config_key(cluster)
    for _ in range(100):
        raw = etcd.get(key)
        new = {**_decode(raw), **checked}
        if etcd.compare_and_swap(key, raw, json.dumps(new, sort_keys=True)):
            return new
    raise RuntimeError(f"could not update {key}: it kept changing under us")


def seed(etcd: EtcdClient, cluster: str, replicas: int) -> int:
    """Store ``replicas`` if no value is set yet; returns the value in force."""
    replicas = validate("replicas", replicas)
    key = layout.config_key(cluster)
    for _ in range(100):
        raw = etcd.get(key)
        current = _decode(raw)
        if "replicas" in current:
            in_force = replicas_of(current)
            if in_force != replicas:
                log.warning("--replicas %d ignored: the cluster's setting is %d (change it with "
                            "`kvstore config set replicas N`)", replicas, in_force)
            return in_force
        new = {**current, "replicas": replicas}
        if etcd.compare_and_swap(key, raw, json.dumps(new, sort_keys=True)):
            return replicas
    raise RuntimeError(f"could not seed {key}: it kept changing under us")
