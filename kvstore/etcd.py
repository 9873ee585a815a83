"""A small etcd v3 client over etcd's HTTP/JSON gateway (etcd >= 3.4).

Why the gateway and not gRPC: see docs/architecture.md ("etcd client"). Every call is a
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
- ``watch_prefix`` returns a ``Watch``: an iterator of ``WatchEvent`` that another thread may
  ``close()`` at any time (the blocked reader wakes up and the iteration ends). While idle it
  probes etcd every ``probe_interval`` seconds, so a silent partition surfaces as
  ``EtcdUnavailable`` instead of a watch that waits forever.
- Plain ``http://`` endpoints only (TLS is not supported yet).
"""

from __future__ import annotations

import base64
import json
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import urlsplit

import httpx

from .errors import KVStoreError, StoreUnavailable

__all__ = [
    "EtcdClient",
    "EtcdError",
    "EtcdUnavailable",
    "LeaseExpired",
    "Watch",
    "WatchCompacted",
    "WatchEvent",
    "prefix_range_end",
]

_START_HINT = (
    "is etcd running there? Start one with `etcd --listen-client-urls http://127.0.0.1:2379 "
    "--advertise-client-urls http://127.0.0.1:2379` or pass the right --etcd URL"
)
_GRPC_NOT_FOUND = 5
_GRPC_UNAVAILABLE = 14


class EtcdError(KVStoreError):
    """etcd refused or failed a request (the message carries etcd's own reason)."""


class EtcdUnavailable(EtcdError, StoreUnavailable):
    """No etcd endpoint could be reached, or etcd has no leader. Retry later."""


class LeaseExpired(EtcdError):
    """The lease expired or never existed: grant a new one (and re-put its keys)."""


class WatchCompacted(EtcdError):
    """The watch start revision was compacted away: re-read the range and watch again."""

    def __init__(self, message: str, compact_revision: int) -> None:
        super().__init__(message)
        self.compact_revision = compact_revision


@dataclass(frozen=True, slots=True)
class WatchEvent:
    """One change under a watched prefix. ``value`` is b"" for a delete."""

    type: Literal["put", "delete"]
    key: str
    value: bytes
    mod_revision: int


def _b64(data: str | bytes) -> str:
    raw = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    return base64.b64encode(raw).decode("ascii")


def _unb64(text: str | None) -> bytes:
    return base64.b64decode(text) if text else b""


def prefix_range_end(prefix: str | bytes) -> bytes:
    """The etcd ``range_end`` that selects every key starting with ``prefix``."""
    raw = bytearray(prefix.encode("utf-8") if isinstance(prefix, str) else prefix)
    while raw:
        if raw[-1] < 0xFF:
            raw[-1] += 1
            return bytes(raw)
        raw.pop()
    return b"\0"  # empty prefix: every key


def _parse_endpoints(endpoints: str | list[str]) -> list[str]:
    items = endpoints.split(",") if isinstance(endpoints, str) else list(endpoints)
    out = []
    for item in (e.strip() for e in items):
        if not item:
            continue
        if "://" not in item:
            item = "http://" + item
        parts = urlsplit(item)
        if parts.scheme != "http" or not parts.hostname or not parts.port:
            raise ValueError(f"etcd endpoint must look like http://HOST:PORT, got {item!r}")
        out.append(f"http://{parts.hostname}:{parts.port}")
    if not out:
        raise ValueError("at least one etcd endpoint is required")
    return out


class EtcdClient:
    """Synchronous, thread-safe etcd v3 client (see the module docstring for the contract)."""

    def __init__(self, endpoints: str | list[str], timeout: float = 2.0) -> None:
        self.endpoints = _parse_endpoints(endpoints)
        self.timeout = float(timeout)
        self._http = httpx.Client(
            timeout=httpx.Timeout(self.timeout, connect=min(self.timeout, 1.0)),
            headers={"Content-Type": "application/json"},
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
            + _START_HINT
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
            watch = Watch(self, sock, endpoint, json.dumps(body).encode(), probe_interval)
            with self._lock:
                if self._closed:
                    watch.close()
                    raise EtcdError("EtcdClient is closed")
                self._watches.add(watch)
            return watch
        raise EtcdUnavailable(
            f"etcd unreachable at {', '.join(self.endpoints)} for a watch ({last}); " + _START_HINT
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


class Watch:
    """An open watch stream: iterate for ``WatchEvent``s; ``close()`` from any thread.

    Iteration ends quietly after ``close()``; it raises ``EtcdUnavailable`` when the stream
    breaks or etcd stops answering probes, and ``WatchCompacted`` when the start revision is
    gone. A Watch is iterated by one thread.
    """

    def __init__(
        self, client: EtcdClient, sock: socket.socket, endpoint: str, body: bytes,
        probe_interval: float,
    ) -> None:
        self._client = client
        self._sock = sock
        self._endpoint = endpoint
        self._body = body
        self._probe_interval = probe_interval
        self._closed = threading.Event()
        self._buf = bytearray()

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes a reader blocked in recv
        except OSError:
            pass
        self._sock.close()
        self._client._forget(self)

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def __enter__(self) -> "Watch":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __iter__(self) -> Iterator[WatchEvent]:
        try:
            yield from self._events()
        except OSError as exc:
            if not self.closed:
                raise self._broken(f"{type(exc).__name__}: {exc}") from exc
        finally:
            self.close()

    # -- HTTP/1.1 streaming, by hand so a recv can time out (probe) and resume -------------

    def _broken(self, why: str) -> EtcdUnavailable:
        return EtcdUnavailable(f"etcd watch stream from {self._endpoint} broke ({why}); {_START_HINT}")

    def _recv(self) -> bool:
        """Append received bytes to the buffer; False on EOF or close. Probes while idle."""
        while not self.closed:
            try:
                data = self._sock.recv(65536)
            except TimeoutError:
                self._client.ping()  # raises EtcdUnavailable when etcd is gone
                continue
            if not data:
                return False
            self._buf += data
            return True
        return False

    def _read_line(self) -> bytes | None:
        while (i := self._buf.find(b"\r\n")) < 0:
            if not self._recv():
                return None
        line = bytes(self._buf[:i])
        del self._buf[: i + 2]
        return line

    def _read_exact(self, n: int) -> bytes | None:
        while len(self._buf) < n:
            if not self._recv():
                return None
        out = bytes(self._buf[:n])
        del self._buf[:n]
        return out

    def _events(self) -> Iterator[WatchEvent]:
        host = urlsplit(self._endpoint).netloc
        self._sock.sendall(
            b"POST /v3/watch HTTP/1.1\r\nHost: " + host.encode() + b"\r\n"
            b"Content-Type: application/json\r\nConnection: close\r\n"
            b"Content-Length: " + str(len(self._body)).encode() + b"\r\n\r\n" + self._body
        )
        self._sock.settimeout(self._probe_interval)
        status = self._read_line()
        if status is None:
            if self.closed:
                return
            raise self._broken("closed before answering")
        headers: dict[str, str] = {}
        while line := self._read_line():
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        if line is None:
            if self.closed:
                return
            raise self._broken("truncated headers")
        code = status.split(b" ")[1:2]
        if code != [b"200"]:
            why = f"etcd watch at {self._endpoint} refused: {status.decode('latin-1')}"
            raise EtcdUnavailable(why) if code[:1] == [b"503"] else EtcdError(why)
        chunked = "chunked" in headers.get("transfer-encoding", "")
        pending = bytearray()
        while not self.closed:
            if chunked:
                size_line = self._read_line()
                if size_line is None:
                    break
                size = int(size_line.split(b";")[0], 16)
                if size == 0:
                    break
                data = self._read_exact(size + 2)
                if data is None:
                    break
                pending += data[:-2]
            else:
                if not self._recv():
                    break
                pending += self._buf
                self._buf.clear()
            while (j := pending.find(b"\n")) >= 0:
                message = bytes(pending[:j])
                del pending[: j + 1]
                if message.strip():
                    yield from self._parse(json.loads(message))
        if not self.closed:
            raise self._broken("stream ended")

    def _parse(self, message: dict) -> Iterator[WatchEvent]:
        if "error" in message:
            err = message["error"]
            raise self._broken(err.get("message", str(err)) if isinstance(err, dict) else str(err))
        result = message.get("result", {})
        if result.get("canceled"):
            compact = int(result.get("compact_revision", 0))
            if compact:
                raise WatchCompacted(
                    f"watch start revision was compacted (oldest kept: {compact}); "
                    "re-read the range and watch from its revision + 1", compact
                )
            raise self._broken(f"watch canceled by etcd: {result.get('cancel_reason', '')}")
        for ev in result.get("events", ()):
            kv = ev["kv"]
            yield WatchEvent(
                type="delete" if ev.get("type") == "DELETE" else "put",
                key=_unb64(kv["key"]).decode("utf-8", "surrogateescape"),
                value=_unb64(kv.get("value")),
                mod_revision=int(kv.get("mod_revision", 0)),
            )
