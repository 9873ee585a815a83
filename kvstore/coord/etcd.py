"""A small etcd v3 client over etcd's HTTP/JSON gateway (etcd >= 3.4).

Why the gateway and not gRPC: see docs/decisions/0001-etcd-http-gateway.md. Every call is a
``POST /v3/...`` with a JSON body; keys and values travel base64-encoded, int64 fields as
decimal strings, and fields at their default value (0, false, "PUT") are omitted in replies.

Contract:

- ``EtcdClient`` is thread-safe: one instance may be shared by every thread of a process.
- Several endpoints give failover: a call goes to the endpoint that last answered and moves
  on to the next when it cannot connect. Only idempotent calls are re-sent after a request
  may have reached a server (a transaction or lease grant is never applied twice).
- An unreachable etcd fails fast (connect timeout <= 1 s) with ``EtcdUnavailable``, which is
  both an ``EtcdError`` and a ``StoreUnavailable``; an expired or unknown lease raises
  ``LeaseExpired``; a compacted watch start revision raises ``WatchCompacted``.
- ``watch_prefix`` returns a ``Watch`` (``kvstore.coord.watch``): an iterator of ``WatchEvent`` that another thread may
  ``close()`` at any time (the blocked reader wakes up and the iteration ends). While idle it
  probes etcd every ``probe_interval`` seconds, so a silent partition surfaces as
  ``EtcdUnavailable`` instead of a watch that waits forever.
- ``http://`` and ``https://`` endpoints. On https the client presents the process's TLS
  certificate (``tls``, by default ``kvstore.tls.current()``) and verifies etcd's against
  the cluster CA, for the gateway calls and the watch streams alike (etcd started with
  ``--cert-file --key-file --trusted-ca-file --client-cert-auth``); with no TLS settings an
  https etcd is verified against the system's CAs and gets no client certificate. An
  endpoint without a scheme is https when TLS is configured, else http.
"""

from __future__ import annotations

import json
import socket
import ssl
import threading
from typing import Any, Literal
from urllib.parse import urlsplit

import httpx

from kvstore import tls as tls_settings
from kvstore.coord.encoding import b64 as _b64
from kvstore.coord.encoding import prefix_range_end
from kvstore.coord.encoding import unb64 as _unb64
from kvstore.coord.watch import Watch, WatchEvent
from kvstore.errors import ETCD_START_HINT, EtcdError, EtcdUnavailable, LeaseExpired, WatchCompacted

__all__ = [
    "EtcdClient",
    "EtcdError",
    "EtcdUnavailable",
    "LeaseExpired",
    "Watch",
    "WatchCompacted",
    "WatchEvent",
    "client_for",
    "prefix_range_end",
]

_GRPC_NOT_FOUND = 5
_GRPC_UNAVAILABLE = 14


def _parse_endpoints(endpoints: str | list[str], scheme: str = "http") -> list[str]:
    items = endpoints.split(",") if isinstance(endpoints, str) else list(endpoints)
    out = []
    for item in (e.strip() for e in items):
        if not item:
            continue
        if "://" not in item:
            item = f"{scheme}://{item}"
        parts = urlsplit(item)
        if parts.scheme not in ("http", "https") or not parts.hostname or not parts.port:
            raise ValueError(f"etcd endpoint must look like http(s)://HOST:PORT, got {item!r}")
        host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
        out.append(f"{parts.scheme}://{host}:{parts.port}")
    if not out:
        raise ValueError("at least one etcd endpoint is required")
    return out


class EtcdClient:
    """Synchronous, thread-safe etcd v3 client (see the module docstring for the contract)."""

    def __init__(self, endpoints: str | list[str], timeout: float = 2.0,
                 tls: tls_settings.TLSConfig | Literal[False] | None = None) -> None:
        self.tls = tls_settings.current() if tls is None else (tls or None)
        self.endpoints = _parse_endpoints(endpoints, "https" if self.tls else "http")
        self.timeout = float(timeout)
        self._ssl = self.tls.client_context() if self.tls else ssl.create_default_context()
        self._http = httpx.Client(
            timeout=httpx.Timeout(self.timeout, connect=min(self.timeout, 1.0)),
            headers={"Content-Type": "application/json"}, verify=self._ssl,
        )
        self._preferred = 0
        self._lock = threading.Lock()
        self._watches: set[Watch] = set()
        self._closed = False

    # -- plumbing -------------------------------------------------------------------------

    def _order(self) -> list[str]:
        i = self._preferred
        return self.endpoints[i:] + self.endpoints[:i]

    def _call(self, path: str, body: dict[str, Any], *, idempotent: bool = True) -> dict:
        if self._closed:
            raise EtcdError("EtcdClient is closed")
        last: Exception | None = None
        content = json.dumps(body)
        for endpoint in self._order():
            # A pooled keep-alive connection may have died with a restarted etcd: an idempotent
            # call gets one more try on the same endpoint (a fresh connection) before moving on.
            for _ in range(2 if idempotent else 1):
                try:
                    resp = self._http.post(endpoint + path, content=content)
                    break
                except httpx.ConnectError as exc:  # never reached a server: try the next one
                    last, resp = exc, None
                    break
                except (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError) as exc:
                    last, resp = exc, None
                except httpx.TransportError as exc:  # a timeout: slow or cut-off server
                    last, resp = exc, None
                    break
            if resp is None:
                if idempotent or isinstance(last, httpx.ConnectError):
                    continue
                break
            self._preferred = self.endpoints.index(endpoint)
            return self._decode(path, endpoint, resp)
        # Everything failed: next time, start with the endpoint after the current one.
        self._preferred = (self._preferred + 1) % len(self.endpoints)
        raise EtcdUnavailable(
            f"etcd unreachable at {', '.join(self.endpoints)} ({type(last).__name__}: {last}); "
            + ETCD_START_HINT
        ) from last

    @staticmethod
    def _decode(path: str, endpoint: str, resp: httpx.Response) -> dict:
        try:
            data = resp.json()
        except ValueError:
            data = {}
        if resp.status_code == 200 and "error" not in data:
            return data
        message = data.get("message") or data.get("error") or resp.text[:200]
        code = data.get("code")
        if code == _GRPC_NOT_FOUND and "lease not found" in str(message):
            raise LeaseExpired(f"{message}: grant a new lease")
        if code == _GRPC_UNAVAILABLE or resp.status_code == 503:
            raise EtcdUnavailable(f"etcd at {endpoint} is unavailable ({message}); retry later")
        raise EtcdError(f"etcd {path} at {endpoint} failed: {message} (code {code})")

    # -- key/value ------------------------------------------------------------------------

    def put(self, key: str | bytes, value: bytes | str, lease: int | None = None) -> int:
        """Store ``value`` under ``key`` (attached to ``lease`` if given). Returns the revision."""
        body: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease:
            body["lease"] = str(lease)
        return int(self._call("/v3/kv/put", body)["header"].get("revision", 0))

    def get(self, key: str | bytes) -> bytes | None:
        """The value under ``key``, or None when there is none."""
        kvs = self._call("/v3/kv/range", {"key": _b64(key)}).get("kvs")
        return _unb64(kvs[0].get("value")) if kvs else None

    def get_prefix(self, prefix: str | bytes) -> tuple[dict[str, bytes], int]:
        """Every key under ``prefix`` with its value, and the store revision of that view.

        Watch from ``revision + 1`` to see every later change exactly once.
        """
        body = {"key": _b64(prefix), "range_end": _b64(prefix_range_end(prefix))}
        data = self._call("/v3/kv/range", body)
        out = {
            _unb64(kv["key"]).decode("utf-8", "surrogateescape"): _unb64(kv.get("value"))
            for kv in data.get("kvs", ())
        }
        return out, int(data["header"].get("revision", 0))

    def delete(self, key: str | bytes) -> int:
        """Delete ``key``; returns how many keys were deleted (0 or 1)."""
        return int(self._call("/v3/kv/deleterange", {"key": _b64(key)}).get("deleted", 0))

    def delete_prefix(self, prefix: str | bytes) -> int:
        """Delete every key under ``prefix``; returns how many were deleted."""
        body = {"key": _b64(prefix), "range_end": _b64(prefix_range_end(prefix))}
        return int(self._call("/v3/kv/deleterange", body).get("deleted", 0))

    def compare_and_swap(
        self, key: str | bytes, expected: bytes | None, new: bytes | str, lease: int | None = None
    ) -> bool:
        """Atomically set ``key`` to ``new`` iff its value is ``expected`` (None: key absent)."""
        k = _b64(key)
        if expected is None:
            compare = {"key": k, "result": "EQUAL", "target": "CREATE", "create_revision": "0"}
        else:
            compare = {"key": k, "result": "EQUAL", "target": "VALUE", "value": _b64(expected)}
        put: dict[str, Any] = {"key": k, "value": _b64(new)}
        if lease:
            put["lease"] = str(lease)
        body = {"compare": [compare], "success": [{"request_put": put}]}
        return bool(self._call("/v3/kv/txn", body, idempotent=False).get("succeeded", False))

    def ping(self) -> int:
        """Round-trip to etcd; returns the current store revision. Raises EtcdUnavailable."""
        data = self._call("/v3/kv/range", {"key": _b64(b"\0"), "count_only": True})
        return int(data["header"].get("revision", 0))

    # -- leases ---------------------------------------------------------------------------

    def lease_grant(self, ttl: int) -> int:
        """Grant a lease of ``ttl`` whole seconds (etcd may raise it to its minimum)."""
        data = self._call("/v3/lease/grant", {"TTL": str(int(ttl))}, idempotent=False)
        if data.get("error"):
            raise EtcdError(f"lease grant failed: {data['error']}")
        return int(data["ID"])

    def lease_keepalive(self, lease: int) -> int:
        """Renew ``lease``; returns its TTL in seconds. Raises LeaseExpired if it is gone."""
        data = self._call("/v3/lease/keepalive", {"ID": str(lease)})
        ttl = int(data.get("result", {}).get("TTL", 0))
        if ttl <= 0:
            raise LeaseExpired(f"lease {lease:x} expired: grant a new lease and re-put its keys")
        return ttl

    def lease_revoke(self, lease: int) -> None:
        """Revoke ``lease``, deleting its keys at once. Revoking a gone lease is a no-op."""
        try:
            self._call("/v3/lease/revoke", {"ID": str(lease)})
        except LeaseExpired:
            pass

    # -- watch ----------------------------------------------------------------------------

    def watch_prefix(
        self, prefix: str | bytes, start_revision: int, probe_interval: float = 2.0
    ) -> "Watch":
        """Watch every key under ``prefix`` from ``start_revision`` on (see ``Watch``)."""
        body = {
            "create_request": {
                "key": _b64(prefix),
                "range_end": _b64(prefix_range_end(prefix)),
                "start_revision": str(int(start_revision)),
            }
        }
        last: Exception | None = None
        for endpoint in self._order():
            parts = urlsplit(endpoint)
            try:
                sock = socket.create_connection(
                    (parts.hostname, parts.port), timeout=min(self.timeout, 1.0)
                )
            except OSError as exc:
                last = exc
                continue
            if parts.scheme == "https":
                try:
                    sock = self._ssl.wrap_socket(sock, server_hostname=parts.hostname)
                except OSError as exc:  # ssl.SSLError included: a refused certificate
                    sock.close()
                    last = exc
                    continue
            watch = Watch(sock, endpoint, json.dumps(body).encode(), probe_interval,
                          probe=self.ping, on_close=self._forget)
            with self._lock:
                if self._closed:
                    watch.close()
                    raise EtcdError("EtcdClient is closed")
                self._watches.add(watch)
            return watch
        raise EtcdUnavailable(
            f"etcd unreachable at {', '.join(self.endpoints)} for a watch ({last}); " + ETCD_START_HINT
        ) from last

    def _forget(self, watch: "Watch") -> None:
        with self._lock:
            self._watches.discard(watch)

    def close(self) -> None:
        """Close every open watch and the connection pool. Idempotent."""
        with self._lock:
            self._closed = True
            watches = list(self._watches)
        for w in watches:
            w.close()
        self._http.close()

    def __enter__(self) -> "EtcdClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"EtcdClient({','.join(self.endpoints)})"


def client_for(etcd: EtcdClient | str | list[str]) -> tuple[EtcdClient, bool]:
    """(client, owned): endpoints get a client of the caller's own, which it must close."""
    if isinstance(etcd, EtcdClient):
        return etcd, False
    return EtcdClient(etcd), True
