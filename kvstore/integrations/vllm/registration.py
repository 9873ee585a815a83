"""A vLLM instance in the cluster's etcd, so the router finds it as it finds our workers.

The connector's scheduler side registers its instance when ``kv_connector_extra_config`` has a
``register`` object: ``etcd`` (URL), ``cluster`` (default ``kvstore``), ``url`` (where vLLM's
OpenAI server listens, ``http://host:port``), ``role`` (``prefill``, ``decode`` or
``colocated``), and optionally ``worker_id``, ``kv_events`` and ``kv_events_replay`` (vLLM's
ZMQ KV-event endpoints as the router reaches them) and ``ttl`` (seconds, default 5).

Why the connector and not a sidecar: it runs inside the instance and dies with it (its lease
ends within the TTL), and it alone knows the facts the router needs: the namespace its keys
are under, the block size and the KV capacity vLLM allocated. It registers only once the
server's ``/health`` answers 200 (a thread polls it), so the router never sees an instance
that cannot take a request yet, then prints ``kvstore-vllm ready address=URL worker_id=ID``
on stdout (the line ``kvrouter up`` waits for), and keeps the key alive under a lease
(``kvstore.coord.registration``) until vLLM shuts the connector down.

The value is the router's ``WorkerInfo`` etcd value (``engine.api.generate``: that module's
docstring is the spec) with ``"engine": "vllm"``.
"""

from __future__ import annotations

import logging
import threading
import urllib.request
import uuid
from dataclasses import dataclass
from typing import Any, Mapping

from kvstore.coord.registration import Registration, register

__all__ = ["RegisterSettings", "InstanceRegistration"]

log = logging.getLogger(__name__)

ROLES = ("prefill", "decode", "colocated")


@dataclass(frozen=True)
class RegisterSettings:
    etcd: str
    url: str
    role: str
    cluster: str = "kvstore"
    worker_id: str = ""
    kv_events: str | None = None
    kv_events_replay: str | None = None
    ttl: float = 5.0

    @classmethod
    def from_mapping(cls, raw: Any) -> "RegisterSettings":
        where = "kv_connector_extra_config.register"
        if not isinstance(raw, Mapping):
            raise ValueError(f"{where} must be an object with etcd, url and role")
        missing = [k for k in ("etcd", "url", "role") if not raw.get(k)]
        if missing:
            raise ValueError(f"{where} needs {', '.join(missing)}")
        if raw["role"] not in ROLES:
            raise ValueError(f"{where}.role must be one of {ROLES}, got {raw['role']!r}")
        url = str(raw["url"]).rstrip("/")
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"{where}.url must be http://host:port, got {url!r}")
        wid = str(raw.get("worker_id") or f"vllm-{raw['role']}-{uuid.uuid4().hex[:8]}")
        return cls(etcd=str(raw["etcd"]), url=url, role=str(raw["role"]),
                   cluster=str(raw.get("cluster", "kvstore")), worker_id=wid,
                   kv_events=raw.get("kv_events"), kv_events_replay=raw.get("kv_events_replay"),
                   ttl=float(raw.get("ttl", 5.0)))


class InstanceRegistration:
    """Registers ``value`` once ``settings.url``'s ``/health`` answers; ``close`` deregisters."""

    def __init__(self, settings: RegisterSettings, value: dict[str, Any], poll_s: float = 0.5) -> None:
        self.settings, self.value, self._poll_s = settings, value, poll_s
        self._stop = threading.Event()
        self._registration: Registration | None = None
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="kvstore-vllm-register", daemon=True)

    def start(self) -> "InstanceRegistration":
        self._thread.start()
        return self

    @property
    def registered(self) -> bool:
        with self._lock:
            return self._registration is not None and self._registration.registered

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.settings.url + "/health", timeout=2) as resp:
                return resp.status == 200
        except OSError:
            return False

    def _run(self) -> None:
        s = self.settings
        while not self._stop.wait(0 if self._healthy() else self._poll_s):
            if not self._healthy():
                continue
            try:
                reg = register(s.etcd, s.cluster, "workers", s.worker_id, self.value, ttl=s.ttl)
            except Exception as exc:  # noqa: BLE001 - etcd down: keep trying; the instance serves meanwhile
                log.warning("kvstore: cannot register %s in etcd yet: %s", s.worker_id, exc)
                self._stop.wait(max(self._poll_s, 1.0))
                continue
            with self._lock:
                if self._stop.is_set():
                    reg.close()
                else:
                    self._registration = reg
            # The ready line a launcher waits for (router.cluster.launcher), as kvengine prints its own.
            print(f"kvstore-vllm ready address={s.url} worker_id={s.worker_id}", flush=True)
            return

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            if self._registration is not None:
                self._registration.close()
                self._registration = None
