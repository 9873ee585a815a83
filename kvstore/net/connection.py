"""``Connection``: one framed connection from a client to a store daemon.

It owns the socket, the HELLO handshake, the optional mapping of the daemon's arena (the
same-host shared-memory path) and request/response framing (``kvstore.net.protocol``). It is
not thread-safe; ``Client`` serializes requests on it and replaces it after any failure.

Its socket is set up by ``protocol.tune_socket`` (why each setting: see there); the
``timeout`` bounds the connect and every later socket wait, and a timed-out call raises an
``OSError``, which ``Client`` turns into ``StoreUnavailable``.

TLS (``kvstore.tls``): given a client context, the socket is wrapped before HELLO (the
handshake bounded by ``timeout``; the daemon's name checked against the address's host) and
its timeouts are Python's rather than the kernel's (``protocol.is_tls``). A certificate the
daemon does not trust, or one of the daemon that this side does not, is an ``AuthError``
(retrying will not help); HELLO and the cluster secret follow as on plain TCP.
"""

from __future__ import annotations

import os
import socket
import ssl
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvstore.net import protocol as P
from kvstore.node.arena import Arena
from kvstore.errors import AuthError, ProtocolError, StoreUnavailable

__all__ = ["Connection", "Traffic", "parse_address"]


def parse_address(address: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` for IPv6) as a tuple."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"store address must be host:port, got {address!r}")
    return host.strip("[]"), int(port)


@dataclass
class Traffic:
    """Bytes written to and read from the sockets of one client, across reconnects, and how
    often it tried to map a daemon's arena (only where the daemon said it is on this host)."""

    sent: int = 0
    received: int = 0
    map_attempts: int = 0


_CERT_WORDS = ("CERTIFICATE", "UNKNOWN_CA", "BAD_CERT", "CERT_", "VERIFY")


def _tls_failure(address: str, e: BaseException) -> StoreUnavailable | AuthError:
    """What a failed TLS handshake with a daemon raises: a certificate refused (by either
    side) is an ``AuthError``; anything else (a plain-TCP daemon, a cut connection) is
    ``StoreUnavailable``."""
    text = f"{getattr(e, 'reason', '') or ''} {e}"
    if isinstance(e, ssl.CertificateError) or any(w in text.upper() for w in _CERT_WORDS):
        return AuthError(f"TLS with the kvstore daemon at {address} refused a certificate ({e}); "
                         "both ends need certificates of the same CA (--tls-cert/--tls-key/--tls-ca), "
                         "and the daemon's must name the host connected to")
    return StoreUnavailable(f"TLS with the kvstore daemon at {address} failed ({e!r}); does it "
                            "serve TLS (kvstore serve --tls-cert ...), and is it reachable?")


class Connection:
    """A live, authenticated connection (``open``); ``arena`` is set on the shm path."""

    __slots__ = ("sock", "hello", "arena", "arena_np", "rid", "_hdr", "_traffic", "_scratch")

    def __init__(self, sock: socket.socket, traffic: Traffic) -> None:
        self.sock = sock
        self.hello: dict[str, Any] = {}
        self.arena: Arena | None = None
        self.arena_np: np.ndarray | None = None
        self.rid = 0
        self._hdr = memoryview(bytearray(P.HEADER_SIZE))
        self._traffic = traffic
        self._scratch: memoryview | None = None

    @classmethod
    def open(cls, address: str, *, token: str | None, timeout: float, want: str,
             traffic: Traffic, tls: ssl.SSLContext | None = None) -> "Connection":
        """Connect, handshake (TLS first, given ``tls``) and (unless ``want`` is ``"tcp"``)
        map the daemon's arena."""
        host, port = parse_address(address)
        try:
            sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as e:
            raise StoreUnavailable(f"cannot reach a kvstore daemon at {address} ({e}); "
                                   "check that `kvstore serve` runs there and is reachable") from None
        try:
            P.tune_socket(sock, timeout)
            if tls is not None:
                sock.settimeout(timeout)
                sock = tls.wrap_socket(sock, server_hostname=host)
        except (ssl.SSLError, ssl.CertificateError, OSError) as e:
            sock.close()
            raise _tls_failure(address, e) from None
        conn = cls(sock, traffic)
        try:
            _, meta = conn.exchange(P.Op.HELLO, P.pack_json(
                {"token": token, "host_id": P.local_host_id(), "pid": os.getpid()}))
            conn.hello = P.unpack_json(meta)
        except (ssl.SSLError, ssl.CertificateError) as e:
            sock.close()
            raise _tls_failure(address, e) from None
        except (OSError, EOFError) as e:
            sock.close()
            hint = ("" if tls is not None else ", and does it require TLS (--tls-cert/--tls-key/"
                    "--tls-ca, $KVCACHE_TLS_CERT...)")
            raise StoreUnavailable(f"kvstore daemon at {address} dropped the handshake "
                                   f"({e!r}); is it a kvstore daemon, is it overloaded{hint}?") from None
        except BaseException:
            sock.close()
            raise
        if want != "tcp":
            conn._attach()
            if conn.arena is None and want == "shm":
                conn.close()
                raise StoreUnavailable(f"transport='shm' but the arena of {address} cannot be "
                                       "mapped here (another host?); use transport='auto' or 'tcp'")
        return conn

    def _attach(self) -> None:
        arena = self.hello.get("arena")
        if not arena or self.hello.get("host_id") != P.local_host_id():
            return
        self._traffic.map_attempts += 1
        try:
            mapped = Arena.attach(arena["name"])
        except (OSError, ValueError):
            return
        if mapped.size != arena["size"]:
            mapped.close()
            return
        self.arena = mapped
        self.arena_np = np.frombuffer(mapped.buf, np.uint8)

    def close(self) -> None:
        self.arena_np = None
        if self.arena is not None:
            self.arena.close()
        self.sock.close()

    # --- framing ---------------------------------------------------------------------------

    def exchange(self, op: P.Op, meta: bytes, data: list | None = None,
                 keep_data: bool = False) -> tuple[P.Header, memoryview]:
        """Send one request and read its response header and meta. With ``keep_data`` the
        response's data is left on the socket for the caller to read (``recv``)."""
        self.rid += 1
        data_len = sum(d.nbytes for d in data) if data else 0
        head = P.pack_header(op, 0, self.rid, len(meta), data_len)
        if data:
            P.send_buffers(self.sock, [head, meta, *data])
        else:
            self.sock.sendall(head + meta)
        self._traffic.sent += P.HEADER_SIZE + len(meta) + data_len
        self.recv([self._hdr])
        h = P.unpack_header(self._hdr)
        if h.flags & P.FLAG_ERROR and h.request_id == 0:  # about the connection (protocol.py)
            rmeta = memoryview(bytearray(min(h.meta_len, 1 << 16)))
            self.recv([rmeta])
            raise P.error_from_meta(rmeta)
        if h.request_id != self.rid or h.op != op or not h.flags & P.FLAG_RESPONSE:
            raise ProtocolError(f"response (op {h.op}, id {h.request_id}) does not answer "
                                f"request (op {int(op)}, id {self.rid})")
        rmeta = memoryview(bytearray(h.meta_len))
        self.recv([rmeta])
        if h.flags & P.FLAG_ERROR:
            raise P.error_from_meta(rmeta)
        if h.data_len and not keep_data:
            self.drain(h.data_len)
        return h, rmeta

    def send_oneway(self, op: P.Op, meta: bytes) -> None:
        """A NO_REPLY request (only UNPIN): the daemon answers only if it fails, and then
        the next response is out of step and the connection is dropped."""
        self.rid += 1
        self.sock.sendall(P.pack_header(op, P.FLAG_NO_REPLY, self.rid, len(meta)) + meta)
        self._traffic.sent += P.HEADER_SIZE + len(meta)

    def recv(self, views: list) -> None:
        """Fill each writable view in order (scatter reads, as few syscalls as possible)."""
        self._traffic.received += P.recv_buffers(self.sock, views)

    def drain(self, nbytes: int) -> None:
        if self._scratch is None:
            self._scratch = memoryview(bytearray(1 << 20))
        P.drain(self.sock, nbytes, self._scratch)
        self._traffic.received += nbytes
