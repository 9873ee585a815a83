"""``Connection``: one framed connection from a client to a store daemon.

It owns the socket, the HELLO handshake, the optional mapping of the daemon's arena (the
same-host shared-memory path) and of its index (``kvstore.node.shared_index``: gets with no
round trip), the reads to report (TOUCH) and request/response framing
(``kvstore.net.protocol``). It is not thread-safe; ``Client`` serializes requests on it and
replaces it after any failure.

The index belongs to the daemon instance whose HELLO named it, so it is used only while this
connection is open: ``index_ready()`` polls the socket (no wait) before each use, and a
hung-up or readable socket (the daemon died, restarted, timed the connection out, or sent an
error frame) sends the get down the socket path, which reads what is there and fails or
reconnects, mapping the new instance's index. Reads the index served are kept
(``note_read``) and reported as one-way TOUCH frames: before the connection's next request
(so the daemon applies them first), once ``TOUCH_KEYS`` keys or ``TOUCH_DELAY_S`` seconds
are pending (``touch_due``), and, waiting for the answer, at close.

Its socket is set up by ``sockio.tune_socket`` (why each setting: see there); the
``timeout`` bounds the connect and every later socket wait, and a timed-out call raises an
``OSError``, which ``Client`` turns into ``StoreUnavailable``.

TLS (``kvstore.tls``): given a client context, the socket is wrapped before HELLO (the
handshake bounded by ``timeout``; the daemon's name checked against the address's host) and
its timeouts are Python's rather than the kernel's (``sockio.is_tls``). A certificate the
daemon does not trust, or one of the daemon that this side does not, is an ``AuthError``
(retrying will not help); HELLO and the cluster secret follow as on plain TCP.
"""

from __future__ import annotations

import logging
import os
import select
import socket
import ssl
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvstore.errors import AuthError, KVStoreError, ProtocolError, StoreUnavailable
from kvstore.net import protocol as P
from kvstore.net import sockio, ucx
from kvstore.net.host_id import local_host_id
from kvstore.node.arena import Arena
from kvstore.node.shared_index import IndexReader

__all__ = ["Connection", "Traffic", "parse_address", "TOUCH_KEYS", "TOUCH_DELAY_S"]

log = logging.getLogger(__name__)

TOUCH_KEYS = 512      # distinct keys read through the index before a TOUCH goes out ...
TOUCH_DELAY_S = 0.05  # ... or this long after the first of them, at the next get (a TOUCH
                      # wakes the daemon, which on 2 CPUs delays the get that sent it: every
                      # 5 ms took a 4 KiB get's p99 from ~40 to ~125 us when gets were 150 us apart)
_HUNG = select.POLLIN | select.POLLPRI | select.POLLERR | select.POLLHUP | getattr(select, "POLLRDHUP", 0)


def parse_address(address: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` for IPv6) as a tuple."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"store address must be host:port, got {address!r}")
    return host.strip("[]"), int(port)


@dataclass
class Traffic:
    """Bytes written to and read from the sockets of one client, across reconnects, how
    often it tried to map a daemon's arena (only where the daemon said it is on this host),
    and how many blocks the daemon's shared-memory index served with no request."""

    sent: int = 0
    received: int = 0
    map_attempts: int = 0
    index_hits: int = 0


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

    __slots__ = ("sock", "hello", "arena", "arena_np", "index", "rid", "_hdr", "_traffic",
                 "_scratch", "_poll", "_tls", "_reads", "_reads_since", "ucx")

    def __init__(self, sock: socket.socket, traffic: Traffic) -> None:
        self.sock = sock
        self.hello: dict[str, Any] = {}
        self.arena: Arena | None = None
        self.arena_np: np.ndarray | None = None
        self.index: IndexReader | None = None
        self.rid = 0
        self._hdr = memoryview(bytearray(P.HEADER_SIZE))
        self._traffic = traffic
        self._scratch: memoryview | None = None
        self._poll: Any = None
        self._tls = False
        self._reads: dict[bytes, list[int]] = {}  # key -> [reads, size], oldest first
        self._reads_since = 0.0
        self.ucx: ucx.Link | None = None  # the UCX data path (kvstore.net.ucx), when set up

    @classmethod
    def open(cls, address: str, *, token: str | None, timeout: float, want: str,
             traffic: Traffic, tls: ssl.SSLContext | None = None,
             use_index: bool = True) -> "Connection":
        """Connect, handshake (TLS first, given ``tls``), then the data path ``want`` asks
        for: ``"auto"`` maps the daemon's arena (and, with ``use_index``, its index) where it
        can, else sets up UCX where the daemon offers it, ucxx imports and TLS is off;
        ``"shm"`` and ``"ucx"`` insist on theirs, ``"tcp"`` sets up neither."""
        host, port = parse_address(address)
        try:
            sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as e:
            raise StoreUnavailable(f"cannot reach a kvstore daemon at {address} ({e}); "
                                   "check that `kvstore serve` runs there and is reachable") from None
        try:
            sockio.tune_socket(sock, timeout)
            if tls is not None:
                sock.settimeout(timeout)
                sock = tls.wrap_socket(sock, server_hostname=host)
        except (ssl.SSLError, ssl.CertificateError, OSError) as e:
            sock.close()
            raise _tls_failure(address, e) from None
        conn = cls(sock, traffic)
        try:
            _, meta = conn.exchange(P.Op.HELLO, P.pack_json(
                {"token": token, "host_id": local_host_id(), "pid": os.getpid()}))
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
        if want in ("auto", "shm"):
            conn._attach(use_index)
            if conn.arena is None and want == "shm":
                conn.close()
                raise StoreUnavailable(f"transport='shm' but the arena of {address} cannot be "
                                       "mapped here (another host?); use transport='auto' or 'tcp'")
        if want == "ucx" and not conn.hello.get("ucx"):
            conn.close()
            raise StoreUnavailable(f"transport='ucx' but the daemon at {address} does not serve UCX "
                                   "(kvstore serve --ucx); use transport='auto' or 'tcp'")
        if want == "ucx" or (want == "auto" and conn.arena is None and conn.hello.get("ucx")
                             and tls is None and ucx.available() is None):
            try:
                conn._link()
            except Exception as e:
                conn.close()
                if want == "auto" and not isinstance(e, (OSError, EOFError)):  # UCX would not start
                    log.warning("UCX with the kvstore daemon at %s failed (%s); using TCP", address, e)
                    return cls.open(address, token=token, timeout=timeout, want="tcp",
                                    traffic=traffic, tls=tls, use_index=use_index)
                if isinstance(e, KVStoreError):
                    raise
                raise StoreUnavailable(f"cannot set up UCX with the kvstore daemon at {address} "
                                       f"({e!r})") from None
            except BaseException:
                conn.close()
                raise
        return conn

    def _link(self) -> None:
        """Set up the UCX data path (the UCX op, ``kvstore.net.ucx``), after HELLO."""
        worker = ucx.Worker()  # the connection's own (ucx.Link says why), closed with it
        prefix = worker.new_prefix()
        try:
            _, meta = self.exchange(P.Op.UCX, P.pack_json({"address": worker.address.hex(),
                                                           "prefix": prefix}))
            ans = P.unpack_json(meta)
            if not isinstance(ans, dict):
                raise ProtocolError("the UCX op's answer must be a JSON object")
            self.ucx = ucx.Link(worker, bytes.fromhex(str(ans.get("address"))), prefix,
                                int(ans.get("prefix") or 0))
        except (ValueError, TypeError) as e:
            worker.close()
            raise ProtocolError(f"a malformed UCX answer from the daemon: {e}") from None
        except BaseException:
            worker.close()
            raise

    def _attach(self, use_index: bool) -> None:
        arena = self.hello.get("arena")
        if not arena or self.hello.get("host_id") != local_host_id():
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
        info = self.hello.get("index")
        if use_index and info:
            self.index = IndexReader.attach(info, self.arena_np)
            if self.index is not None:
                self._poll = select.poll()
                self._poll.register(self.sock.fileno(), _HUNG)
                self._tls = sockio.is_tls(self.sock)

    def close(self) -> None:
        if self.ucx is not None:
            self.ucx.close()
            self.ucx = None
        if self.index is not None:
            self.index.close()
            self.index = None
        self.arena_np = None
        if self.arena is not None:
            self.arena.close()
        self.sock.close()

    # --- the index's reads ------------------------------------------------------------------

    def index_ready(self) -> IndexReader | None:
        """The index, if this connection has one and its socket is quiet (the daemon that
        published it is still the one on the other end, with nothing to say)."""
        if self.index is None or self._poll.poll(0):
            return None
        if self._tls and self.sock.pending():  # type: ignore[attr-defined]
            return None
        return self.index

    def note_read(self, key: bytes, size: int) -> None:
        """One read the index served, to report (the latest is the most recent)."""
        self._traffic.index_hits += 1
        if not isinstance(key, bytes):  # a bytearray or memoryview key: a dict needs bytes
            key = bytes(key)
        reads = self._reads
        r = reads.pop(key, None)
        if r is None:
            if not reads:
                self._reads_since = time.monotonic()
            reads[key] = [1, size]
        else:
            r[0] += 1
            r[1] = size
            reads[key] = r

    def touch_due(self) -> bool:
        reads = self._reads
        return bool(reads) and (len(reads) >= TOUCH_KEYS
                                or time.monotonic() - self._reads_since >= TOUCH_DELAY_S)

    def _touch_frames(self, flags: int = P.FLAG_NO_REPLY) -> bytes:
        """The pending reads as TOUCH frames (at most ``MAX_BATCH`` keys each); clears them."""
        if not self._reads:
            return b""
        items = list(self._reads.items())
        self._reads = {}
        out = []
        for at in range(0, len(items), P.MAX_BATCH):
            part = items[at: at + P.MAX_BATCH]
            meta = P.pack_touch([k for k, _ in part], [r[0] for _, r in part], [r[1] for _, r in part])
            self.rid += 1
            out.append(P.pack_header(P.Op.TOUCH, flags, self.rid, len(meta)) + meta)
        frames = b"".join(out)
        self._traffic.sent += len(frames)
        return frames

    def flush_touches(self) -> None:
        """Send the pending reads now, one-way."""
        frames = self._touch_frames()
        if frames:
            self.sock.sendall(frames)

    def report_touches(self) -> None:
        """Send the pending reads and wait until the daemon has taken them (at close)."""
        if self._reads:  # the pending frames go first (exchange), then an empty TOUCH answered
            self.exchange(P.Op.TOUCH, P.pack_touch([], [], []), expect=0)

    # --- framing ---------------------------------------------------------------------------

    def exchange(self, op: P.Op, meta: bytes, data: list | None = None,
                 keep_data: bool = False, expect: int | None = None,
                 flags: int = 0) -> tuple[P.Header, memoryview]:
        """Send one request and read its response header and meta. With ``keep_data`` the
        response's data is left on the socket for the caller to read (``recv``). ``expect``:
        the meta length a success answers with, so that header and meta come in one
        ``recv``. Pending reads of the index go first, as one-way TOUCH frames in the same
        send."""
        h, rmeta, _ = self.exchange_into(op, meta, data, expect=expect, flags=flags)
        if h.data_len and not keep_data:
            self.drain(h.data_len)
        return h, rmeta

    def exchange_into(self, op: P.Op, meta: bytes, data: list | None = None, *,
                      expect: int | None = None, spill: Any = None, flags: int = 0
                      ) -> tuple[P.Header, memoryview, int]:
        """``exchange`` whose answer's data may start landing in ``spill`` (a writable
        buffer: the destination of a one-block GET) in the same ``recv`` as its header and
        meta; returns (header, meta, data bytes already in ``spill``), the rest of the data
        left on the socket. An error answer may have written into ``spill``."""
        touches = self._touch_frames() if self._reads else b""
        self.rid += 1
        data_len = sum(d.nbytes for d in data) if data else 0
        head = P.pack_header(op, flags, self.rid, len(meta), data_len)
        if data:
            sockio.send_buffers(self.sock, [touches, head, meta, *data])
        else:
            self.sock.sendall(touches + head + meta)
        self._traffic.sent += P.HEADER_SIZE + len(meta) + data_len
        if expect is None:
            self.recv([self._hdr])
            h, rmeta = self._answer(op, P.unpack_header(self._hdr), b"")
            return h, rmeta, 0
        hm = memoryview(bytearray(P.HEADER_SIZE + expect))
        got = sockio.recv_at_least(self.sock, [hm] if spill is None else [hm, spill], P.HEADER_SIZE)
        self._traffic.received += got
        h = P.unpack_header(hm[:P.HEADER_SIZE])
        if h.meta_len == expect and not h.flags & P.FLAG_ERROR:
            self._check_answer(op, h)
            if got < len(hm):
                self.recv([hm[got:]])
            return h, hm[P.HEADER_SIZE:], max(0, got - len(hm))
        # another meta length (an error, normally): what came past the header is its meta's
        early = hm[P.HEADER_SIZE:got].tobytes() + (bytes(memoryview(spill).cast("B")[: got - len(hm)])
                                                   if spill is not None and got > len(hm) else b"")
        if len(early) > h.meta_len:
            raise ProtocolError(f"an answer of op {h.op} with {h.meta_len} bytes of meta where "
                                f"{expect} were expected, and data")
        h, rmeta = self._answer(op, h, early)
        return h, rmeta, 0

    def _check_answer(self, op: P.Op, h: P.Header) -> None:
        if h.request_id != self.rid or h.op != op or not h.flags & P.FLAG_RESPONSE:
            raise ProtocolError(f"response (op {h.op}, id {h.request_id}) does not answer "
                                f"request (op {int(op)}, id {self.rid})")

    def _answer(self, op: P.Op, h: P.Header, early: bytes) -> tuple[P.Header, memoryview]:
        """The rest of an answer's meta after its header (``early``: its first bytes, read
        already); an error answer raises its exception."""
        if h.flags & P.FLAG_ERROR and h.request_id == 0:  # about the connection (protocol.py)
            rmeta = memoryview(bytearray(min(h.meta_len, 1 << 16)))
        else:
            self._check_answer(op, h)
            rmeta = memoryview(bytearray(h.meta_len))
        n = min(len(early), rmeta.nbytes)
        rmeta[:n] = early[:n]
        self.recv([rmeta[n:]])
        if h.flags & P.FLAG_ERROR:
            raise P.error_from_meta(rmeta)
        return h, rmeta

    def send_oneway(self, op: P.Op, meta: bytes) -> None:
        """A NO_REPLY request (UNPIN): the daemon answers only if it fails, and then the next
        response is out of step and the connection is dropped."""
        touches = self._touch_frames() if self._reads else b""
        self.rid += 1
        self.sock.sendall(touches + P.pack_header(op, P.FLAG_NO_REPLY, self.rid, len(meta)) + meta)
        self._traffic.sent += P.HEADER_SIZE + len(meta)

    def recv(self, views: list) -> None:
        """Fill each writable view in order (scatter reads, as few syscalls as possible)."""
        self._traffic.received += sockio.recv_buffers(self.sock, views)

    def drain(self, nbytes: int) -> None:
        if self._scratch is None:
            self._scratch = memoryview(bytearray(1 << 20))
        sockio.drain(self.sock, nbytes, self._scratch)
        self._traffic.received += nbytes
