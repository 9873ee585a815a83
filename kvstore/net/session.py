"""``Session``: one client connection as the daemon serves it: its frames, limits and ops.

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
  capped at ``max_reserve`` bytes, so no single client evicts more than its share of the
  arena before it has sent the bytes.

TLS (``kvstore.tls``): a TLS session's handshake runs in non-blocking steps as well
(``kvstore.net.tls_io``; ``want_write``: wait for writability), within the HELLO deadline;
a refused certificate or a peer not speaking TLS ends it (``tls_handshake``). The frame
deadline is then the socket's Python timeout, and ``buffered()`` tells the server to serve
the session again when TLS holds decrypted bytes that epoll cannot see.

Whatever the session has reserved or pinned (``owner=self``; the GPU tier's too, through the
CUDA IPC ops of ``kvstore.net.gpu_ops``) is released by ``release()``, which the server calls
however the session ends.

UCX (``kvstore.net.ucx``, the spec): after HELLO a client may set up a ``UcxChannel``; its
``FLAG_UCX`` GETs and RESERVEs then move blocks as UCX messages, and ``release()`` closes the
channel (cancelling what it posted) before it frees a slot.
"""

from __future__ import annotations

import collections
import dataclasses
import hmac
import logging
import socket
import time
from typing import TYPE_CHECKING, Any, Callable, Literal, NoReturn, Protocol

import numpy as np

from kvstore.errors import AuthError, KVStoreError, ProtocolError, StoreFull
from kvstore.keys import BlockKey
from kvstore.net import gpu_ops, sockio, tls_io
from kvstore.net import protocol as P
from kvstore.net.frames import Close, FrameReader, FrameTimeout
from kvstore.net.limits import ServerLimits
from kvstore.node.store import BlockStore

if TYPE_CHECKING:
    from kvstore.net.ucx import Worker
    from kvstore.net.ucx_channel import UcxChannel

__all__ = ["Session", "SessionHost", "ServerMetrics", "Close", "FrameTimeout", "Direction",
           "DataPath", "DropReason"]

log = logging.getLogger("kvstore.net.server")

_BURST = 64  # frames served in one step before the session yields its thread
_OP_NAMES = {int(op): op.name.lower() for op in P.Op}  # the metrics' op label

Direction = Literal["in", "out"]   # KV bytes put into / got out of the store
DataPath = Literal["tcp", "shm", "ucx", "cuda_ipc"]  # socket / arena / UCX / GPU tier (gpu_ops)
DropReason = Literal["limit", "fd_exhausted", "hello_timeout", "idle_timeout", "frame_timeout",
                     "tls_handshake"]


class ServerMetrics(Protocol):
    """What the server reports to, as it serves (``kvstore.daemon.metrics.StoreMetrics``)."""

    def observe(self, op: str, seconds: float) -> None:
        """One request of ``op`` (a protocol op's name, lower case) took ``seconds``."""

    def transferred(self, direction: Direction, path: DataPath, nbytes: int) -> None:
        """``nbytes`` of values moved."""

    def error(self, code: str) -> None:
        """One error answer of ``code`` (an error code's name, lower case)."""

    def dropped(self, reason: DropReason) -> None:
        """The daemon closed (or refused) one connection for ``reason``."""

    def accept_error(self) -> None:
        """``accept`` failed for want of file descriptors (EMFILE, ENFILE)."""


class SessionHost(Protocol):
    """What a session needs of its server (``kvstore.net.server.StoreServer``)."""

    store: BlockStore
    limits: ServerLimits
    max_reserve: int  # bytes one connection may hold reserved (HELLO's max_data)
    token: bytes | None
    metrics: ServerMetrics | None
    node_id: str
    host_id: str
    ucx: Worker | None  # the daemon's UCX worker, when it serves UCX (kvstore serve --ucx)

    def server_stats(self) -> dict[str, Any]: ...


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
        if not self._close_ucx() or self.stuck:
            return
        try:
            self.store.release_owner(self)
            self.reserved.clear()
            self.reserved_bytes = 0
            self.pins.clear()
        except Exception:
            log.exception("releasing the reservations and pins of %s failed", self.peer)

    def count_bytes(self, direction: Direction, path: DataPath, nbytes: int) -> None:
        """Count block bytes moved on ``path`` (the daemon's transfer metrics)."""
        if self.server.metrics is not None and nbytes:
            self.server.metrics.transferred(direction, path, nbytes)

    def _check_reserve(self, total: int, op: str) -> None:
        cap = self.server.max_reserve
        if self.reserved_bytes + total > cap:
            raise StoreFull(
                f"a {op} of {total} bytes would hold {self.reserved_bytes + total} bytes "
                f"reserved on this connection, over its {cap}-byte cap (max_data); put fewer "
                "blocks at once, commit reservations first, or raise the daemon's --max-conn-reserve")

    # --- ops ----------------------------------------------------------------------------

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

    def _put(self, h: P.Header, meta: memoryview) -> None:
        keys, sizes = P.unpack_keys_sizes(meta)
        total = sum(sizes)
        if total != h.data_len:
            raise ProtocolError(f"PUT declares blocks of {total} bytes in all but carries "
                                f"{h.data_len} bytes of data")
        try:
            self._check_reserve(total, "PUT")
        except StoreFull as e:
            self.fail(h.op, h.request_id, e)  # too much to drain: end the connection
        try:
            res = self.store.reserve(list(zip(keys, sizes)), owner=self)
        except StoreFull:
            self.reader.drain(total)
            raise
        # The reservations are this session's (owner=self): if the frame breaks off or runs
        # past its deadline, release() aborts them. ``self.reserved`` tracks only RESERVE's,
        # which the client commits or aborts in later frames.
        buf = self.store.arena.buf
        for r, s in zip(res, sizes):
            if r is None:
                self.reader.drain(s)
            else:
                self.reader.read_into(buf[r.offset: r.offset + s])
        self.store.commit([k for k, r in zip(keys, res) if r is not None])
        self.count_bytes("in", "tcp", total)
        self.reply(h, bytes(1 if r is not None else 0 for r in res))

    def _get(self, h: P.Header, meta: memoryview) -> None:
        keys = P.unpack_keys(meta)
        # Pinned for the send only, and unpinned below however it ends: no owner to track.
        locs = self.store.pin(keys)
        pinned = [k for k, loc in zip(keys, locs) if loc is not None]
        try:
            buf = self.store.arena.buf
            if len(locs) == 1:
                loc = locs[0]
                sizes = (P.MISSING if loc is None else loc.size).to_bytes(8, "little")
            else:
                sizes = np.fromiter((loc.size if loc is not None else P.MISSING for loc in locs),
                                    dtype="<u8", count=len(locs)).tobytes()
            data = [buf[loc.offset: loc.offset + loc.size] for loc in locs if loc is not None]
            if self.ucx is not None and h.flags & P.FLAG_UCX:
                self.reply(h, sizes)
                try:
                    self.ucx.send_blocks(h.request_id, data, [i for i, loc in enumerate(locs) if loc is not None],
                                         time.monotonic() + self.server.limits.frame_timeout)
                except ConnectionError as e:  # unpinned below once the channel is closed
                    log.info("closing connection %s: %s", self.peer, e)
                    if not self._close_ucx():
                        pinned = []
                    raise Close() from None
                self.count_bytes("out", "ucx", sum(v.nbytes for v in data))
            else:
                self.reply(h, sizes, data)
                self.count_bytes("out", "tcp", sum(v.nbytes for v in data))
        finally:
            if pinned:
                self.store.unpin(pinned)

    def _close_ucx(self) -> bool:
        """Close the channel now; False when a request outlived it (module docstring)."""
        channel, self.ucx = self.ucx, None
        if channel is None or channel.close():
            return True
        log.error("connection %s: UCX requests did not finish after the endpoint closed; "
                  "its reservations and pins are kept", self.peer)
        self.stuck = True
        return False

    def _contains(self, h: P.Header, meta: memoryview) -> None:
        self.reply(h, bytes(self.store.contains(P.unpack_keys(meta))))

    def _prefix_len(self, h: P.Header, meta: memoryview) -> None:
        self.reply(h, P._U32.pack(self.store.prefix_len(P.unpack_keys(meta))))

    def _delete(self, h: P.Header, meta: memoryview) -> None:
        self.reply(h, P._U32.pack(self.store.delete(P.unpack_keys(meta))))

    def _stats(self, h: P.Header, meta: memoryview) -> None:
        stats = dataclasses.asdict(self.store.stats())
        self.reply(h, P.pack_json({"store": stats, "server": self.server.server_stats()}))

    def _reserve(self, h: P.Header, meta: memoryview) -> None:
        keys, sizes = P.unpack_keys_sizes(meta)
        self._check_reserve(sum(sizes), "RESERVE")
        res = self.store.reserve(list(zip(keys, sizes)), owner=self)
        for k, r, s in zip(keys, res, sizes):
            if r is not None:
                self.reserved[k] = s
                self.reserved_bytes += s
        if self.ucx is not None and h.flags & P.FLAG_UCX:  # the values come as UCX messages
            buf = self.store.arena.buf
            mine = [(i, r.offset, s) for i, (r, s) in enumerate(zip(res, sizes)) if r is not None]
            self.ucx.post(h.request_id, [keys[i] for i, _, _ in mine],
                          [buf[off: off + s] for _, off, s in mine], [i for i, _, _ in mine])
        offsets = np.fromiter((r.offset if r is not None else P.MISSING for r in res),
                              dtype="<u8", count=len(res))
        self.reply(h, offsets.tobytes())

    def _owned_reservations(self, keys: list[BlockKey], verb: str) -> int:
        missing = [k for k in keys if k not in self.reserved]
        if missing:
            raise ProtocolError(f"{verb} of {len(missing)} key(s) this connection has not "
                                f"reserved (first {missing[0].hex()})")
        nbytes = sum(self.reserved.pop(k) for k in keys)
        self.reserved_bytes -= nbytes
        return nbytes

    def _commit(self, h: P.Header, meta: memoryview) -> None:
        keys = P.unpack_keys(meta)
        path: DataPath = "shm"
        if self.ucx is not None and self.ucx.posted(keys):
            path = "ucx"
            try:
                self.ucx.take(keys, self.server.limits.frame_timeout)
            except ConnectionError as e:
                self.fail(h.op, h.request_id, ProtocolError(f"COMMIT of values that did not arrive: {e}"))
        nbytes = self._owned_reservations(keys, "COMMIT")
        self.store.commit(keys)
        self.count_bytes("in", path, nbytes)
        self.reply(h)

    def _abort(self, h: P.Header, meta: memoryview) -> None:
        keys = P.unpack_keys(meta)
        if self.ucx is not None and self.ucx.posted(keys):
            raise ProtocolError("ABORT of keys whose values are expected over UCX: close the "
                                "connection instead (kvstore.net.ucx)")
        self._owned_reservations(keys, "ABORT")
        self.store.abort(keys)
        self.reply(h)

    def _pin(self, h: P.Header, meta: memoryview) -> None:
        keys = P.unpack_keys(meta)
        locs = self.store.pin(keys, owner=self)
        n = len(keys)
        out = np.full(2 * n, P.MISSING, dtype="<u8")
        nbytes = 0
        for i, (k, loc) in enumerate(zip(keys, locs)):
            if loc is not None:
                self.pins[k] += 1
                out[i], out[n + i] = loc.offset, loc.size
                nbytes += loc.size
        self.count_bytes("out", "shm", nbytes)
        self.reply(h, out.tobytes())

    def _unpin(self, h: P.Header, meta: memoryview) -> None:
        keys = P.unpack_keys(meta)
        need = collections.Counter(keys)
        bad = [k for k, c in need.items() if self.pins[k] < c]
        if bad:
            raise ProtocolError(f"UNPIN of {len(bad)} key(s) this connection has not pinned "
                                f"(first {bad[0].hex()})")
        self.pins.subtract(need)
        self.pins = +self.pins
        self.store.unpin(keys, owner=self)
        if not h.flags & P.FLAG_NO_REPLY:
            self.reply(h)

    def _ucx(self, h: P.Header, meta: memoryview) -> None:
        worker = self.server.ucx
        if worker is None:
            raise ProtocolError("this daemon does not serve UCX (kvstore serve --ucx)")
        if self.ucx is not None:
            raise ProtocolError("a second UCX op on one connection")
        from kvstore.net.ucx_channel import UcxChannel

        self.ucx = UcxChannel(worker, P.unpack_json(meta), self.fd)
        self.reply(h, P.pack_json(self.ucx.hello()))

    def _touch(self, h: P.Header, meta: memoryview) -> None:
        keys, counts, sizes = P.unpack_touch(meta)
        self.count_bytes("out", "shm", self.store.touch(keys, counts, sizes))
        if not h.flags & P.FLAG_NO_REPLY:
            self.reply(h)


_HANDLERS: dict[int, Callable[[Session, P.Header, memoryview], None]] = {
    P.Op.HELLO: Session._hello, P.Op.PUT: Session._put, P.Op.GET: Session._get,
    P.Op.CONTAINS: Session._contains, P.Op.PREFIX_LEN: Session._prefix_len,
    P.Op.DELETE: Session._delete, P.Op.STATS: Session._stats, P.Op.RESERVE: Session._reserve,
    P.Op.COMMIT: Session._commit, P.Op.ABORT: Session._abort, P.Op.PIN: Session._pin,
    P.Op.UNPIN: Session._unpin, P.Op.TOUCH: Session._touch, P.Op.UCX: Session._ucx,
    **gpu_ops.HANDLERS}
