"""Registration: a process's key in etcd, kept alive under a lease while it serves.

The lifecycle every registered process follows (store daemon, engine worker, router)::

    registration = register(etcd, cluster, kind, member_id, value, ttl=...)  # or Registration(...).start()
    ... serve ...
    registration.close()                                                     # deregister

- ``register`` / ``start()`` grants a lease of ``ttl`` seconds (whole seconds, at least 1)
  and puts ``value`` (one JSON object) under the key ``kvstore.coord.layout`` gives the member;
  it raises ``EtcdUnavailable`` if etcd cannot be reached then, which is a start-up error.
- A daemon thread renews the lease every TTL/3. When the lease was lost (etcd restarted with
  fresh data, a partition longer than the TTL) it grants a new one and puts the value again;
  while etcd is unreachable ``registered`` is False and ``last_error`` says why.
- ``close()`` revokes the lease: the key is gone at once, not after the TTL. It never raises.
  A process that dies stops renewing, and etcd deletes its key within the TTL (plus etcd's
  ~0.5 s expiry sweep).

Draining and deregistering: where a process calls ``close()`` relative to its drain is part
of its contract, so it stays with the process. A store daemon stops accepting connections,
deregisters, then drains (a client must not pick a node that refuses it); an engine worker
drains, then deregisters (the router keeps the streams of in-flight requests to the workers it
knows; a draining worker refuses new requests with 503 and says "draining" on /health); a
router deregisters when its server has stopped.

Why a module of its own rather than part of ``membership``: registering (one key, written)
and watching members (a prefix, read) are two things with two callers, and each is one noun.
"""

from __future__ import annotations

import json
import logging
import math
import threading
from collections.abc import Mapping
from typing import Any

from kvstore.coord import layout
from kvstore.coord.etcd import EtcdClient, EtcdError, LeaseExpired, client_for

__all__ = ["DEFAULT_TTL", "Registration", "register"]

log = logging.getLogger(__name__)

DEFAULT_TTL = 5.0
"""Seconds a dead process stays registered at most; the one default of every ``--registration-ttl``."""


def register(
    etcd: EtcdClient | str, cluster: str, kind: layout.Kind, member_id: str,
    value: Mapping[str, Any], *, ttl: float = DEFAULT_TTL,
) -> "Registration":
    """Register ``value`` as member ``member_id`` of ``kind`` in ``cluster`` now, and keep it
    registered until ``close()``. Raises ``EtcdUnavailable`` when etcd cannot be reached and
    ``ValueError`` for a malformed cluster name or id (``kvstore.coord.layout``)."""
    return Registration(etcd, layout.key(cluster, kind, member_id), value, ttl=ttl).start()


class Registration:
    """One key kept alive under a lease (see the module docstring). Use as a context manager,
    or ``start()`` and ``close()``."""

    def __init__(
        self, etcd: EtcdClient | str, key: str, value: Mapping[str, Any], ttl: float = DEFAULT_TTL
    ) -> None:
        if ttl <= 0:
            raise ValueError(f"ttl must be positive, got {ttl}")
        self._etcd, self._owns_etcd = client_for(etcd)
        self.key = key
        self.ttl = ttl
        self._value = json.dumps(dict(value), sort_keys=True).encode("utf-8")
        self._lease: int | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.last_error: Exception | None = None

    @property
    def lease_id(self) -> int | None:
        return self._lease

    @property
    def registered(self) -> bool:
        """True while the last grant or renewal succeeded."""
        return self._lease is not None and self.last_error is None

    def start(self) -> "Registration":
        if self._thread is not None:
            raise RuntimeError(f"registration of {self.key} already started")
        self._register()
        self._thread = threading.Thread(
            target=self._run, name=f"etcd-registration:{self.key}", daemon=True
        )
        self._thread.start()
        return self

    def update(self, value: Mapping[str, Any]) -> None:
        """Replace the registered value (same lease)."""
        encoded = json.dumps(dict(value), sort_keys=True).encode("utf-8")
        with self._lock:
            self._value = encoded
            if self._lease is not None:
                self._etcd.put(self.key, encoded, lease=self._lease)

    def _register(self) -> None:
        with self._lock:
            lease = self._etcd.lease_grant(max(1, math.ceil(self.ttl)))
            try:
                self._etcd.put(self.key, self._value, lease=lease)
            except EtcdError:
                self._etcd.lease_revoke(lease)
                raise
            self._lease = lease
            self.last_error = None

    def _run(self) -> None:
        interval = self.ttl / 3
        while not self._stop.wait(interval):
            try:
                lease = self._lease
                if lease is None:
                    self._register()
                    continue
                self._etcd.lease_keepalive(lease)
                self.last_error = None
            except LeaseExpired as exc:
                log.warning("lease of %s lost (%s); registering again", self.key, exc)
                self._lease = None
                self._retry_register()
            except EtcdError as exc:
                if self.last_error is None:
                    log.warning("cannot renew registration of %s: %s", self.key, exc)
                self.last_error = exc

    def _retry_register(self) -> None:
        try:
            self._register()
        except EtcdError as exc:
            self.last_error = exc

    def close(self) -> None:
        """Deregister: stop renewing and revoke the lease (the key disappears now). Never
        raises (a shutdown path must go on): when etcd cannot be reached it logs, and the key
        expires with its lease within the TTL. Idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self._etcd.timeout + 1.0)
        lease, self._lease = self._lease, None
        if lease is not None:
            try:
                self._etcd.lease_revoke(lease)
            except Exception as exc:  # noqa: BLE001 - etcd gone or broken: the lease expires anyway
                log.warning("could not revoke the lease of %s (%s); the key expires within %g s",
                            self.key, exc, self.ttl)
        if self._owns_etcd:
            self._etcd.close()

    def __enter__(self) -> "Registration":
        return self if self._thread is not None else self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
