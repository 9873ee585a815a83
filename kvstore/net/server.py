"""The daemon's socket server: one thread per connection over a ``BlockStore``.

Each connection is served by its own thread with a blocking socket (see docs/architecture.md,
"Threads, not asyncio"): a PUT's values are ``recv_into``'d straight into their reserved
arena slots and a GET's values are sent with ``sendmsg`` straight from their pinned slots,
the GIL released during each copy. The wire format is ``kvstore.net.protocol``.

A connection's reservations and pins are made with the connection as their ``owner`` and
released (``BlockStore.release_owner``) when it ends, however it ends (clean close, bad input, a dead peer, an I/O timeout mid-frame). Bad input closes that
connection only. ``shutdown()`` stops accepting, lets every connection finish the operation
it is in, then returns; the caller closes the store afterwards.
"""

from __future__ import annotations

import collections
import dataclasses
import hmac
import logging
import os
import select
import socket
import threading
import time
import uuid
from typing import Any, Callable, Literal, NoReturn, Protocol

import numpy as np

from kvstore.net import protocol as P
from kvstore.errors import AuthError, KVStoreError, ProtocolError, StoreFull
from kvstore.keys import BlockKey
from kvstore.node.store import BlockStore

__all__ = ["ServerMetrics", "StoreServer", "load_node_id"]

log = logging.getLogger(__name__)

_IDLE_POLL_S = 0.25  # how often an idle connection notices shutdown
_SCRATCH = 1 << 20


def load_node_id(ssd_path: str | None) -> str:
    """The node's stable identity: kept in ``{ssd_path}/node_id`` so a restarted node owns
    the same keys; a fresh one per run when the node has no SSD data."""
    if not ssd_path:
        return uuid.uuid4().hex
    os.makedirs(ssd_path, exist_ok=True)
    path = os.path.join(ssd_path, "node_id")
    try:
        with open(path) as f:
            node_id = f.read().strip()
        if node_id:
            return node_id
    except FileNotFoundError:
        pass
    node_id = uuid.uuid4().hex
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(node_id + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return node_id


Direction = Literal["in", "out"]   # KV bytes put into / got out of the store
DataPath = Literal["tcp", "shm"]   # through the socket / through the shared-memory arena


class ServerMetrics(Protocol):
    """What the server reports to, as it serves (``kvstore.daemon.metrics.StoreMetrics``)."""

    def observe(self, op: str, seconds: float) -> None:
        """One request of ``op`` (a protocol op's name, lower case) took ``seconds``."""

    def transferred(self, direction: Direction, path: DataPath, nbytes: int) -> None:
        """``nbytes`` of values moved."""

    def error(self, code: str) -> None:
        """One error answer of ``code`` (an error code's name, lower case)."""


class _Close(Exception):
    """End this connection (after an error frame was sent, or the stream is unusable)."""


class StoreServer:
    """Serves one ``BlockStore`` over the kvstore protocol.

    ``metrics`` (optional, a ``ServerMetrics``) receives ``observe(op, seconds)``,
    ``transferred(direction, path, nbytes)`` and ``error(code)`` calls. Construction has no side effects; ``bind()`` opens
    the listening socket and ``serve_forever()`` accepts until ``shutdown()``.
    """

    def __init__(self, store: BlockStore, *, host: str, port: int, node_id: str,
                 auth_token: str | None = None, io_timeout: float = 30.0,
                 metrics: ServerMetrics | None = None) -> None:
        self.store = store
        self.node_id = node_id
        self.host_id = P.local_host_id()
        self._host, self._port = host, port
        self._token = auth_token.encode() if auth_token else None
        self._io_timeout = io_timeout
        self.metrics = metrics
        self._listener: socket.socket | None = None
        self._stopping = threading.Event()
        self._conns: set[_Connection] = set()
        self._lock = threading.Lock()
        self._started = time.monotonic()
        self.address: tuple[str, int] | None = None

    def bind(self) -> tuple[str, int]:
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self._host, self._port))
        sock.listen(128)
        sock.settimeout(_IDLE_POLL_S)
        self._listener = sock
        address: tuple[str, int] = sock.getsockname()[:2]
        self.address = address
        return address

    def serve_forever(self) -> None:
        assert self._listener is not None, "bind() first"
        while not self._stopping.is_set():
            try:
                sock, peer = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:
                if self._stopping.is_set():
                    break
                raise
            P.tune_socket(sock, self._io_timeout)
            conn = _Connection(self, sock, peer)
            with self._lock:
                self._conns.add(conn)
            threading.Thread(target=conn.run, name=f"kvstore-conn-{peer}", daemon=True).start()
        self._listener.close()

    def stop_accepting(self) -> None:
        self._stopping.set()

    def shutdown(self, timeout: float = 10.0) -> bool:
        """Stop accepting and wait up to ``timeout`` for every connection to finish its
        current operation and close. True when all did."""
        self._stopping.set()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if not self._conns:
                    return True
            time.sleep(0.02)
        with self._lock:
            log.warning("%d connection(s) still busy after %.1fs", len(self._conns), timeout)
            return not self._conns

    @property
    def connection_count(self) -> int:
        with self._lock:
            return len(self._conns)

    def server_stats(self) -> dict[str, Any]:
        return {"node_id": self.node_id, "host_id": self.host_id,
                "address": f"{self.address[0]}:{self.address[1]}" if self.address else None,
                "connections": self.connection_count,
                "uptime_s": round(time.monotonic() - self._started, 3)}

    def _forget(self, conn: "_Connection") -> None:
        with self._lock:
            self._conns.discard(conn)


class _Connection:
    """One client connection: its socket, its reservations and pins, its request loop."""

    def __init__(self, server: StoreServer, sock: socket.socket, peer) -> None:
        self.server = server
        self.store = server.store
        self.sock = sock
        self.peer = peer
        self.authed = False
        self.reserved: dict[BlockKey, int] = {}
        self.pins: collections.Counter[BlockKey] = collections.Counter()
        self._hdr = memoryview(bytearray(P.HEADER_SIZE))
        self._scratch: memoryview | None = None
        self._poller = select.poll()
        self._poller.register(sock, select.POLLIN)
        self._handlers: dict[int, Callable[[P.Header, memoryview], None]] = {
            P.Op.HELLO: self._hello, P.Op.PUT: self._put, P.Op.GET: self._get,
            P.Op.CONTAINS: self._contains, P.Op.PREFIX_LEN: self._prefix_len,
            P.Op.DELETE: self._delete, P.Op.STATS: self._stats, P.Op.RESERVE: self._reserve,
            P.Op.COMMIT: self._commit, P.Op.ABORT: self._abort, P.Op.PIN: self._pin,
            P.Op.UNPIN: self._unpin,
        }

    # --- loop ---------------------------------------------------------------------------

    def run(self) -> None:
        try:
            while True:
                header = self._read_header()
                if header is None:
                    break
                self._serve(header)
        except _Close:
            pass
        except (ConnectionError, TimeoutError, OSError) as e:
            log.debug("connection %s dropped: %s", self.peer, e)
        except Exception:  # a bug: log it, but never take the daemon down with one connection
            log.exception("connection %s failed", self.peer)
        finally:
            self._release()
            try:
                self.sock.close()
            finally:
                self.server._forget(self)

    def _read_header(self) -> P.Header | None:
        """The next frame's header; None on a clean close or when the server is stopping.

        The socket is blocking with the I/O timeout in the kernel (``tune_socket``); an idle
        connection waits in ``poll`` instead, waking every ``_IDLE_POLL_S`` to notice
        ``shutdown()``. A frame whose first bytes have already arrived is in flight: it is
        served even when shutdown began meanwhile; only an idle connection is closed."""
        while not self._poller.poll(_IDLE_POLL_S * 1000):
            if self.server._stopping.is_set():
                return None
        got = self.sock.recv_into(self._hdr, P.HEADER_SIZE)
        if got == 0:
            return None
        P.recv_exact(self.sock, self._hdr[got:])
        try:
            return P.unpack_header(self._hdr)
        except ProtocolError as e:
            self._fail(0, 0, e)

    def _serve(self, h: P.Header) -> None:
        if h.flags & P.FLAG_RESPONSE:
            self._fail(h.op, h.request_id, ProtocolError("a client sent a response frame"))
        if h.flags & P.FLAG_NO_REPLY and h.op != P.Op.UNPIN:
            self._fail(h.op, h.request_id, ProtocolError("only UNPIN may be sent with NO_REPLY"))
        handler = self._handlers.get(h.op)
        if handler is None:
            self._fail(h.op, h.request_id, ProtocolError(
                f"unknown op {h.op}; this daemon speaks ops {[int(o) for o in P.Op]}"))
        if h.data_len and h.op != P.Op.PUT:
            self._fail(h.op, h.request_id, ProtocolError(f"op {P.Op(h.op).name} carries no data"))
        meta = memoryview(bytearray(h.meta_len))
        P.recv_exact(self.sock, meta)
        if not self.authed and h.op != P.Op.HELLO:
            self._fail(h.op, h.request_id, AuthError("the first frame of a connection must be HELLO"))
        t0 = time.perf_counter()
        try:
            handler(h, meta)
        except (ProtocolError, AuthError) as e:
            self._fail(h.op, h.request_id, e)
        except KVStoreError as e:
            if h.flags & P.FLAG_NO_REPLY:  # nobody waits for this answer: end the stream
                self._fail(h.op, h.request_id, e)
            self._error(h.op, h.request_id, e)
        finally:
            if self.server.metrics is not None:
                self.server.metrics.observe(P.Op(h.op).name.lower(), time.perf_counter() - t0)

    # --- replies ------------------------------------------------------------------------

    def _reply(self, h: P.Header, meta: bytes = b"", data: list | None = None) -> None:
        data_len = sum(v.nbytes for v in data) if data else 0
        head = P.pack_header(h.op, P.FLAG_RESPONSE, h.request_id, len(meta), data_len)
        if data:
            P.send_buffers(self.sock, [head, meta, *data])
        else:
            self.sock.sendall(head + meta)

    def _error(self, op: int, rid: int, exc: KVStoreError) -> None:
        code = P.error_code_for(exc)
        if self.server.metrics is not None:
            self.server.metrics.error(code.name.lower())
        meta = P.pack_error(code, str(exc))
        self.sock.sendall(P.pack_header(op, P.FLAG_RESPONSE | P.FLAG_ERROR, rid, len(meta)) + meta)

    def _fail(self, op: int, rid: int, exc: KVStoreError) -> NoReturn:
        """Answer ``exc`` if the socket still takes it, then end the connection."""
        log.info("closing connection %s: %s", self.peer, exc)
        try:
            self._error(op, rid, exc)
        except OSError:
            pass
        raise _Close()

    def _drain(self, nbytes: int) -> None:
        if self._scratch is None:
            self._scratch = memoryview(bytearray(_SCRATCH))
        P.drain(self.sock, nbytes, self._scratch)

    def _release(self) -> None:
        try:
            self.store.release_owner(self)
            self.reserved.clear()
            self.pins.clear()
        except Exception:
            log.exception("releasing the reservations and pins of %s failed", self.peer)

    def _count(self, direction: Direction, path: DataPath, nbytes: int) -> None:
        if self.server.metrics is not None and nbytes:
            self.server.metrics.transferred(direction, path, nbytes)

    # --- ops ----------------------------------------------------------------------------

    def _hello(self, h: P.Header, meta: memoryview) -> None:
        req = P.unpack_json(meta)
        if not isinstance(req, dict):
            raise ProtocolError("HELLO meta must be a JSON object")
        token = self.server._token
        if token is not None:
            given = str(req.get("token") or "").encode()
            if not hmac.compare_digest(given, token):
                raise AuthError("wrong or missing auth token: pass the daemon's --auth-token "
                                "(or set KVSTORE_AUTH_TOKEN) on the client")
        self.authed = True
        arena = self.store.arena
        self._reply(h, P.pack_json({
            "node_id": self.server.node_id, "host_id": self.server.host_id,
            "arena": {"name": arena.name, "size": arena.size},
            "max_batch": P.MAX_BATCH, "max_data": min(P.MAX_DATA, arena.size),
        }))

    def _put(self, h: P.Header, meta: memoryview) -> None:
        keys, sizes = P.unpack_keys_sizes(meta)
        total = sum(sizes)
        if total != h.data_len:
            raise ProtocolError(f"PUT declares blocks of {total} bytes in all but carries "
                                f"{h.data_len} bytes of data")
        arena = self.store.arena
        if total > arena.size:
            self._fail(h.op, h.request_id, StoreFull(
                f"a PUT of {total} bytes exceeds this node's {arena.size}-byte arena; "
                "put fewer blocks at once or raise --memory"))
        try:
            res = self.store.reserve(list(zip(keys, sizes)), owner=self)
        except StoreFull:
            self._drain(total)
            raise
        # The reservations are this connection's (owner=self): if the frame breaks off, the
        # connection's end aborts them. ``self.reserved`` tracks only RESERVE's, which the
        # client commits or aborts in later frames.
        buf = arena.buf
        for r, s in zip(res, sizes):
            if r is None:
                self._drain(s)
            else:
                P.recv_exact(self.sock, buf[r.offset: r.offset + s])
        self.store.commit([k for k, r in zip(keys, res) if r is not None])
        self._count("in", "tcp", total)
        self._reply(h, bytes(1 if r is not None else 0 for r in res))

    def _get(self, h: P.Header, meta: memoryview) -> None:
        keys = P.unpack_keys(meta)
        locs = self.store.pin(keys, owner=self)
        pinned = [k for k, loc in zip(keys, locs) if loc is not None]
        try:
            buf = self.store.arena.buf
            sizes = np.fromiter((loc.size if loc is not None else P.MISSING for loc in locs),
                                dtype="<u8", count=len(locs))
            data = [buf[loc.offset: loc.offset + loc.size] for loc in locs if loc is not None]
            self._reply(h, sizes.tobytes(), data)
            self._count("out", "tcp", sum(v.nbytes for v in data))
        finally:
            if pinned:
                self.store.unpin(pinned, owner=self)

    def _contains(self, h: P.Header, meta: memoryview) -> None:
        self._reply(h, bytes(self.store.contains(P.unpack_keys(meta))))

    def _prefix_len(self, h: P.Header, meta: memoryview) -> None:
        self._reply(h, P._U32.pack(self.store.prefix_len(P.unpack_keys(meta))))

    def _delete(self, h: P.Header, meta: memoryview) -> None:
        self._reply(h, P._U32.pack(self.store.delete(P.unpack_keys(meta))))

    def _stats(self, h: P.Header, meta: memoryview) -> None:
        stats = dataclasses.asdict(self.store.stats())
        self._reply(h, P.pack_json({"store": stats, "server": self.server.server_stats()}))

    def _reserve(self, h: P.Header, meta: memoryview) -> None:
        keys, sizes = P.unpack_keys_sizes(meta)
        res = self.store.reserve(list(zip(keys, sizes)), owner=self)
        for k, r, s in zip(keys, res, sizes):
            if r is not None:
                self.reserved[k] = s
        offsets = np.fromiter((r.offset if r is not None else P.MISSING for r in res),
                              dtype="<u8", count=len(res))
        self._reply(h, offsets.tobytes())

    def _owned_reservations(self, keys: list[BlockKey], verb: str) -> int:
        missing = [k for k in keys if k not in self.reserved]
        if missing:
            raise ProtocolError(f"{verb} of {len(missing)} key(s) this connection has not "
                                f"reserved (first {missing[0].hex()})")
        return sum(self.reserved.pop(k) for k in keys)

    def _commit(self, h: P.Header, meta: memoryview) -> None:
        keys = P.unpack_keys(meta)
        nbytes = self._owned_reservations(keys, "COMMIT")
        self.store.commit(keys)
        self._count("in", "shm", nbytes)
        self._reply(h)

    def _abort(self, h: P.Header, meta: memoryview) -> None:
        keys = P.unpack_keys(meta)
        self._owned_reservations(keys, "ABORT")
        self.store.abort(keys)
        self._reply(h)

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
        self._count("out", "shm", nbytes)
        self._reply(h, out.tobytes())

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
            self._reply(h)
