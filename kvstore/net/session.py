"""``Session``: one client connection as the daemon serves it: its frames, limits and what
it holds; the connection's own ops (HELLO, UCX), the others dispatched to ``kvstore.net.store_ops``
(PUT to TOUCH) and ``kvstore.net.gpu_ops`` (CUDA IPC).

A session is served in steps (``step()``) by one of the server's serving threads, whenever
its socket is readable; between steps it waits in the server's epoll set and holds no thread
(``kvstore.net.server``). A step reads what has arrived without blocking until a whole
header is in, then serves frames while more are waiting. How frames are read (exact before
HELLO and on TLS, through the serving thread's buffer after it; the frame deadline) is
``kvstore.net.frames``'s:

- Before HELLO succeeds nothing blocks and nothing but the 32-byte header and a HELLO meta
  of at most ``MAX_HELLO_META`` bytes is held: a peer that has not authenticated cannot
  make the daemon allocate, or hold a thread.
- A header is checked as a whole (op, flags, ``meta_limit(op)``, data only on PUT) before a
  byte of its meta is read or allocated.
- An authenticated frame's meta and data are then read with blocking ``recv_into`` (a PUT's
  values straight into their reserved arena slots; a GET's answer is ``sendmsg``'d from its
  pinned slots) under one deadline for the whole frame, counted from its first byte
  (``frame_timeout``), not per receive call: a frame that trickles in is cut off at it.
- What one connection holds reserved (a PUT in flight, RESERVEs not yet committed) is
  capped at ``max_reserve`` bytes (enforced by the ops that reserve, ``kvstore.net.store_ops``),
  so no single client evicts more than its share of the arena before it has sent the bytes.

TLS (``kvstore.tls``): a TLS session's handshake runs in non-blocking steps as well
(``kvstore.net.tls_io``; ``want_write``: wait for writability), within the HELLO deadline;
a refused certificate or a peer not speaking TLS ends it (``tls_handshake``). The frame
deadline is then the socket's Python timeout, and ``buffered()`` tells the server to serve
the session again when TLS holds decrypted bytes that epoll cannot see.

Whatever the session has reserved or pinned (``owner=self``: by the store ops, and the GPU
tier's through the CUDA IPC ops) is released by ``release()``, which the server calls however
the session ends. What the session needs of its server, and reports to, is
``kvstore.net.session_host``'s.

UCX (``kvstore.net.ucx``, the spec): after HELLO a client may set up a ``UcxChannel``; its
``FLAG_UCX`` GETs and RESERVEs then move blocks as UCX messages, and ``release()`` closes the
channel (cancelling what it posted) before it frees a slot.
"""

from __future__ import annotations

import collections
import hmac
import logging
import socket
import time
from typing import TYPE_CHECKING, Callable, NoReturn

from kvstore.errors import AuthError, KVStoreError, ProtocolError
from kvstore.keys import BlockKey
from kvstore.net import gpu_ops, sockio, store_ops, tls_io
from kvstore.net import protocol as P
from kvstore.net.frames import Close, FrameReader
from kvstore.net.session_host import DataPath, Direction, SessionHost

if TYPE_CHECKING:
    from kvstore.net.ucx_channel import UcxChannel

__all__ = ["Session"]

log = logging.getLogger("kvstore.net.server")

_BURST = 64  # frames served in one step before the session yields its thread
_OP_NAMES = {int(op): op.name.lower() for op in P.Op}  # the metrics' op label


class Session:
    """One connection (module docstring). ``state`` is the server's: "idle" (in the epoll
    set), "busy" (queued for or in a serving thread) or "closed"."""

    __slots__ = ("server", "store", "sock", "fd", "peer", "state", "authed", "opened",
                 "last_active", "reader", "_header", "reserved", "reserved_bytes", "pins", "tls",
                 "handshaking", "ucx", "stuck", "same_host", "__weakref__")

    def __init__(self, server: SessionHost, sock: socket.socket, peer: object, now: float) -> None:
        self.server = server
        self.store = server.store
        self.sock = sock
        self.fd = sock.fileno()
        self.peer = peer
        self.state = "idle"
        self.authed = False
        self.opened = self.last_active = now
        self.reader = FrameReader(sock, server.limits.frame_timeout)
        self._header: P.Header | None = None
        self.reserved: dict[BlockKey, int] = {}
        self.reserved_bytes = 0
        self.pins: collections.Counter[BlockKey] = collections.Counter()
        self.tls = sockio.is_tls(sock)
        self.handshaking = self.tls  # a TLS socket comes before its handshake
        self.ucx: UcxChannel | None = None
        self.stuck = False  # a UCX request outlived its endpoint: keep what it may write
        self.same_host = False  # HELLO's host id is the daemon's (CUDA IPC: kvstore.net.gpu_ops)

    @property
    def frame_started(self) -> float | None:
        """When the first byte of a frame not yet served arrived (the server's sweep)."""
        return self.reader.frame_started

    @property
    def want_write(self) -> bool:
        """Wait for writability, not readability (a TLS step)."""
        return self.reader.want_write

    # --- steps --------------------------------------------------------------------------

    def step(self) -> None:
        """Serve what has arrived, then return to wait for more. Raises ``Close`` (also at
        a clean end of stream), ``FrameTimeout`` or ``OSError`` when the session must end."""
        if self.handshaking and not self._handshake():
            return
        r = self.reader
        r.attach(buffered=self.authed)
        try:
            for _ in range(_BURST):
                h = self._header or self._read_header()
                if h is None:
                    return
                self._header = h
                if not self.authed:
                    meta = r.hello_meta(h)
                    if meta is None:
                        return
                    self._header = None
                    self._run(h, meta)
                else:
                    self._header = None
                    r.begin()
                    self._run(h, r.meta(h))
                r.end_frame()
                self.last_active = time.monotonic()
        finally:
            r.detach()

    def _handshake(self) -> bool:
        """One non-blocking step of the TLS handshake; True once it is done."""
        try:
            step = self.reader.handshake_step()
        except OSError as e:  # ssl.SSLError: a refused certificate, a peer not speaking TLS
            log.info("closing connection %s: TLS handshake failed: %s", self.peer, e)
            if self.server.metrics is not None:
                self.server.metrics.dropped("tls_handshake")
            tls_io.refuse(self.sock)
            raise Close() from None
        self.handshaking = step != "done"
        return not self.handshaking

    def buffered(self) -> bool:
        """Whether TLS holds decrypted bytes epoll cannot see (serve again, do not wait)."""
        return self.tls and not self.handshaking and tls_io.pending(self.sock) > 0

    def _read_header(self) -> P.Header | None:
        try:
            h = self.reader.header()
        except ProtocolError as e:
            self.fail(0, 0, e)
        if h is not None:
            self._check(h)
        return h

    def _check(self, h: P.Header) -> None:
        """Everything a header alone can be refused for, before its meta is read."""
        if h.flags & P.FLAG_RESPONSE:
            self.fail(h.op, h.request_id, ProtocolError("a client sent a response frame"))
        if h.flags & P.FLAG_NO_REPLY and h.op not in P.NO_REPLY_OPS:
            self.fail(h.op, h.request_id, ProtocolError("only UNPIN and TOUCH may be sent with NO_REPLY"))
        if h.flags & P.FLAG_UCX and (h.op not in P.UCX_OPS or self.ucx is None):
            self.fail(h.op, h.request_id, ProtocolError(
                "FLAG_UCX is for GET and RESERVE on a connection that set up UCX (op UCX)"))
        if h.op not in _HANDLERS:
            self.fail(h.op, h.request_id, ProtocolError(
                f"unknown op {h.op}; this daemon speaks ops {[int(o) for o in P.Op]}"))
        if h.data_len and h.op != P.Op.PUT:
            self.fail(h.op, h.request_id, ProtocolError(f"op {P.Op(h.op).name} carries no data"))
        limit = P.meta_limit(h.op)
        if h.meta_len > limit:
            self.fail(h.op, h.request_id, ProtocolError(
                f"{P.Op(h.op).name} meta of {h.meta_len} bytes exceeds its {limit}-byte limit"))
        if not self.authed and h.op != P.Op.HELLO:
            self.fail(h.op, h.request_id, AuthError("the first frame of a connection must be HELLO"))

    def _run(self, h: P.Header, meta: memoryview) -> None:
        metrics = self.server.metrics
        t0 = time.perf_counter()
        try:
            _HANDLERS[h.op](self, h, meta)
        except (ProtocolError, AuthError) as e:
            self.fail(h.op, h.request_id, e)
        except KVStoreError as e:
            if h.flags & P.FLAG_NO_REPLY:  # nobody waits for this answer: end the stream
                self.fail(h.op, h.request_id, e)
            self._error(h.op, h.request_id, e)
        finally:
            if metrics is not None:
                metrics.observe(_OP_NAMES[h.op], time.perf_counter() - t0)

    # --- replies ------------------------------------------------------------------------

    def reply(self, h: P.Header, meta: bytes = b"", data: list | None = None) -> None:
        """Answer request ``h`` (its op and id, the RESPONSE flag) with ``meta`` and ``data``."""
        data_len = sum(v.nbytes for v in data) if data else 0
        head = P.pack_header(h.op, P.FLAG_RESPONSE, h.request_id, len(meta), data_len)
        if data:
            sockio.send_buffers(self.sock, [head, meta, *data])
        else:
            self.sock.sendall(head + meta)

    def _error(self, op: int, rid: int, exc: KVStoreError) -> None:
        code = P.error_code_for(exc)
        if self.server.metrics is not None:
            self.server.metrics.error(code.name.lower())
        meta = P.pack_error(code, str(exc))
        self.sock.sendall(P.pack_header(op, P.FLAG_RESPONSE | P.FLAG_ERROR, rid, len(meta)) + meta)

    def fail(self, op: int, rid: int, exc: KVStoreError) -> NoReturn:
        """Answer ``exc`` if the socket still takes it, then end the session."""
        log.info("closing connection %s: %s", self.peer, exc)
        try:
            self._error(op, rid, exc)
        except OSError:
            pass
        raise Close()

    def release(self) -> None:
        """Abort this session's reservations and drop its pins (idempotent); with a UCX
        channel, only once it closed with nothing left in flight (else they stay: a leak,
        logged, rather than a slot reused under a late message)."""
        if not self.close_ucx() or self.stuck:
            return
        try:
            self.store.release_owner(self)
            self.reserved.clear()
            self.reserved_bytes = 0
            self.pins.clear()
        except Exception:
            log.exception("releasing the reservations and pins of %s failed", self.peer)

    def close_ucx(self) -> bool:
        """Close the channel now; False when a request outlived it (module docstring)."""
        channel, self.ucx = self.ucx, None
        if channel is None or channel.close():
            return True
        log.error("connection %s: UCX requests did not finish after the endpoint closed; "
                  "its reservations and pins are kept", self.peer)
        self.stuck = True
        return False

    def count_bytes(self, direction: Direction, path: DataPath, nbytes: int) -> None:
        """Count block bytes moved on ``path`` (the daemon's transfer metrics)."""
        if self.server.metrics is not None and nbytes:
            self.server.metrics.transferred(direction, path, nbytes)

    # --- the connection's own ops (the store's: kvstore.net.store_ops) ------------------

    def _hello(self, h: P.Header, meta: memoryview) -> None:
        req = P.unpack_json(meta)
        if not isinstance(req, dict):
            raise ProtocolError("HELLO meta must be a JSON object")
        token = self.server.token
        if token is not None:
            given = str(req.get("token") or "").encode()
            if not hmac.compare_digest(given, token):
                raise AuthError("wrong or missing auth token (the cluster secret): give the client "
                                "the daemon's secret (--cluster-secret-file, $KVCACHE_CLUSTER_SECRET)")
        if self.authed:
            raise ProtocolError("a second HELLO on one connection")
        self.authed, self.same_host = True, req.get("host_id") == self.server.host_id
        arena = self.store.arena
        index = self.store.index  # the shared-memory index, if published (shared_index.py)
        self.reply(h, P.pack_json({
            "node_id": self.server.node_id, "host_id": self.server.host_id,
            "arena": {"name": arena.name, "size": arena.size},
            "max_batch": P.MAX_BATCH, "max_data": min(P.MAX_DATA, self.server.max_reserve),
            **({"index": index.info()} if index is not None else {}),
            **({"ucx": True} if self.server.ucx is not None else {}), **gpu_ops.hello_fields(self)}))

    def _ucx(self, h: P.Header, meta: memoryview) -> None:
        worker = self.server.ucx
        if worker is None:
            raise ProtocolError("this daemon does not serve UCX (kvstore serve --ucx)")
        if self.ucx is not None:
            raise ProtocolError("a second UCX op on one connection")
        from kvstore.net.ucx_channel import UcxChannel

        self.ucx = UcxChannel(worker, P.unpack_json(meta), self.fd)
        self.reply(h, P.pack_json(self.ucx.hello()))


_HANDLERS: dict[int, Callable[[Session, P.Header, memoryview], None]] = {
    P.Op.HELLO: Session._hello, P.Op.UCX: Session._ucx, **store_ops.HANDLERS, **gpu_ops.HANDLERS}
