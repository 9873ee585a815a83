"""What every integration needs to reach the store: ``StoreSettings`` (where the store is and
how to authenticate, as the engine's configuration says it) and ``StoreLink`` (a client made on
first use that answers None while the store cannot be reached, trying again once a second).

Settings: ``address`` of one daemon, or ``etcd`` (+ ``cluster``) for every daemon registered
there; ``transport`` ``auto`` (shared memory with a daemon on this host, else TCP) or ``tcp``;
``secret_file`` holding the cluster secret (else ``$KVCACHE_CLUSTER_SECRET`` or
``$KVCACHE_CLUSTER_SECRET_FILE``, read by the client); ``timeout`` in seconds for every connect
and socket wait.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Mapping

import kvstore
from kvstore.integrations.lazy_client import LazyClient

__all__ = ["StoreSettings", "StoreLink"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StoreSettings:
    address: str | None = None
    etcd: str | None = None
    cluster: str = "kvstore"
    transport: str = "auto"
    secret_file: str | None = None
    timeout: float = 5.0

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], where: str) -> "StoreSettings":
        """Settings from ``values`` (unknown keys ignored); ``where`` names them in errors."""
        s = cls(address=values.get("address"), etcd=values.get("etcd"),
                cluster=str(values.get("cluster", "kvstore")),
                transport=str(values.get("transport", "auto")),
                secret_file=values.get("secret_file"), timeout=float(values.get("timeout", 5.0)))
        s.validate(where)
        return s

    def validate(self, where: str) -> None:
        if (self.address is None) == (self.etcd is None):
            raise ValueError(f"set exactly one of 'address' (one daemon, host:port) or 'etcd' "
                             f"(a cluster's etcd URL) in {where}")
        if self.transport not in ("auto", "tcp"):
            raise ValueError(f"'transport' in {where} must be 'auto' or 'tcp', got {self.transport!r}")
        if self.timeout <= 0:
            raise ValueError(f"'timeout' in {where} must be positive, got {self.timeout}")

    def connect(self) -> kvstore.StoreClient:
        token = None
        if self.secret_file:
            with open(self.secret_file) as f:
                token = f.read().strip()
        transport = "tcp" if self.transport == "tcp" else "auto"
        if self.etcd is not None:
            return kvstore.connect(etcd=self.etcd, cluster=self.cluster, auth_token=token,
                                   timeout=self.timeout, transport=transport)
        assert self.address is not None
        return kvstore.connect(self.address, auth_token=token, timeout=self.timeout,
                               transport=transport)


class StoreLink:
    """A ``LazyClient`` that answers None while the store cannot be reached (one attempt to
    connect per ``retry_s``); ``reset`` after a failed call makes the next one reconnect."""

    def __init__(self, settings: StoreSettings, retry_s: float = 1.0) -> None:
        self._lazy, self._retry_s = LazyClient(settings.connect), retry_s
        self._next_try = 0.0

    def get(self) -> kvstore.StoreClient | None:
        if time.monotonic() < self._next_try:
            return None
        try:
            return self._lazy.get()
        except Exception as exc:  # noqa: BLE001 - a store (or etcd) down, a secret file gone: a miss
            self._next_try = time.monotonic() + self._retry_s
            log.debug("kvstore unreachable: %s", exc)
            return None

    def reset(self) -> None:
        """Drop the client after a failed call (the next ``get`` reconnects, throttled)."""
        self._next_try = time.monotonic() + self._retry_s
        self._lazy.close()

    def close(self) -> None:
        self._lazy.close()
