"""``Watch``: one etcd v3 watch stream over the HTTP/JSON gateway, read by hand.

``EtcdClient.watch_prefix`` opens it (``kvstore.coord.etcd``). The gateway answers
``POST /v3/watch`` with a chunked HTTP/1.1 response that never ends: one JSON message per
line, each ``{"result": {"events": [...]}}`` (or ``"canceled"``/``"compact_revision"``, or
``{"error": ...}``). It is parsed here on a plain socket rather than through httpx because
a read must be able to time out, probe etcd (``EtcdClient.ping``) and resume where it was:
a silent partition then surfaces as ``EtcdUnavailable`` instead of a watch that waits
forever, and ``close()`` from another thread wakes the blocked reader
(``shutdown(SHUT_RDWR)``).

The watch knows its client only through the two callables it is given (``probe``, run while
idle, and ``on_close``), so this module does not import ``kvstore.coord.etcd``.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit

from kvstore.coord.encoding import unb64 as _unb64
from kvstore.errors import ETCD_START_HINT, EtcdError, EtcdUnavailable, WatchCompacted

__all__ = ["Watch", "WatchEvent"]


@dataclass(frozen=True, slots=True)
class WatchEvent:
    """One change under a watched prefix. ``value`` is b"" for a delete."""

    type: Literal["put", "delete"]
    key: str
    value: bytes
    mod_revision: int


class Watch:
    """An open watch stream: iterate for ``WatchEvent``s; ``close()`` from any thread.

    Iteration ends quietly after ``close()``; it raises ``EtcdUnavailable`` when the stream
    breaks or etcd stops answering probes, and ``WatchCompacted`` when the start revision is
    gone. A Watch is iterated by one thread.
    """

    def __init__(
        self, sock: socket.socket, endpoint: str, body: bytes, probe_interval: float, *,
        probe: Callable[[], object], on_close: Callable[["Watch"], None],
    ) -> None:
        self._probe = probe
        self._on_close = on_close
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
        self._on_close(self)

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
        return EtcdUnavailable(f"etcd watch stream from {self._endpoint} broke ({why}); {ETCD_START_HINT}")

    def _recv(self) -> bool:
        """Append received bytes to the buffer; False on EOF or close. Probes while idle."""
        while not self.closed:
            try:
                data = self._sock.recv(65536)
            except TimeoutError:
                self._probe()  # EtcdClient.ping: raises EtcdUnavailable when etcd is gone
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
            # A stopping etcd's gateway answers 408 (its gRPC side is gone) or 5xx: unavailable.
            unavailable = code[:1] in ([b"408"], [b"502"], [b"503"], [b"504"])
            raise EtcdUnavailable(why) if unavailable else EtcdError(why)
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
