"""``Client``: one store node, over shared memory on the same host, TCP elsewhere.

The path is chosen at connect time: when the daemon's HELLO reports this machine's host id
and its arena can be mapped (``Arena.attach``), puts are RESERVE + write in place + COMMIT and
gets read the mapped arena, so only keys and offsets cross the socket. A get of plain buffers
first asks the daemon's shared-memory index (``kvstore.node.shared_index``; mapped beside the
arena when HELLO names one, ``shared_index=False`` to leave it): a committed host block is
copied out under its slot's seqlock with no message at all, and the read is reported later in
a batched one-way TOUCH (recency, hit counters; ``kvstore.net.connection``). Keys it does not
settle (absent, SSD- or GPU-resident, a slot that kept changing) and every get with a
``Sink`` among its buffers take the PIN path: PIN + copy from the mapped arena + UNPIN
(``kvstore.client.shm_path``). Otherwise values travel in PUT/GET frames
(``kvstore.client.tcp_path``; the frames are ``kvstore.net.protocol``'s), received straight
into the caller's buffers with scatter reads (one ``recvmsg_into`` fills many blocks; a
one-block get's header, size and first bytes come in one). On another host, where the daemon
serves UCX (``kvstore serve --ucx``), ``ucxx`` imports here and TLS is off, the values travel
as tagged UCX messages instead, from the caller's memory into reserved slots and from pinned
slots into the caller's buffers (``kvstore.client.ucx_path``; the wire in ``kvstore.net.ucx``).
``transport="tcp"``, ``"shm"`` or ``"ucx"`` forces one path. The socket, handshake and framing
live in ``kvstore.net.connection``; what counts as a buffer in ``kvstore.net.buffers``.

Buffers: anything with the buffer protocol (bytes, bytearray, memoryview, NumPy arrays) and
torch tensors (CPU tensors in place; a CUDA tensor through a CPU staging copy). A get's
buffer must be C-contiguous, writable and at least as large as the block; the block fills
its head. A get's buffer may also be a ``kvstore.net.buffers.Sink``, which consumes each
block where it lies: in the pinned arena on shared memory, in its own reused staging array,
right after the block's bytes arrive, over TCP.

Authentication: ``auth_token`` is the cluster secret (``kvstore.secret``); when not given, the
environment's (``$KVCACHE_CLUSTER_SECRET``, ``$KVCACHE_CLUSTER_SECRET_FILE``, then the
deprecated ``$KVSTORE_AUTH_TOKEN``).

TLS (``kvstore.tls``): ``tls`` is a ``TLSConfig``, ``False`` for plain TCP, or ``None``
(the default) for the process's settings (``kvstore.tls.current()``: what the command
configured from its flags, else ``$KVCACHE_TLS_CERT``/``_KEY``/``_CA``). Over TLS both paths
stay: on the daemon's host the values still go through shared memory, and only the control
frames travel in TLS.

Large puts are split to fit the daemon's ``max_data`` (its per-connection cap on in-flight
reservations, from HELLO) as well as ``MAX_BATCH``; each part is stored or not as a whole.

Failure: a refused connection, a connect or I/O timeout or a dropped connection raises
``StoreUnavailable`` at once (``timeout`` bounds every connect and every socket wait; never
a hang); the next call reconnects. Daemon-side errors come back as the typed exceptions of
``kvstore.errors``.

Threads: a ``Client`` is thread-safe (one lock around each request; requests from several
threads are serialized on its one connection). For parallel transfers use one ``Client``
per thread, or ``AsyncClient`` (``kvstore.client.async_client``), which keeps one per worker thread.
"""

from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from typing import Any, Iterator, Literal, Sequence

import numpy as np

from kvstore import secret
from kvstore import tls as tls_settings
from kvstore.client import cuda_path, shm_path, tcp_path, ucx_path
from kvstore.client.transport import TRANSPORTS, Transport
from kvstore.errors import AuthError, KVStoreError, ProtocolError, StoreFull, StoreUnavailable
from kvstore.net import protocol as P
from kvstore.net import ucx
from kvstore.net.buffers import Dest, source_parts
from kvstore.net.connection import Connection, Traffic, parse_address
from kvstore.node import cuda_ipc

__all__ = ["Client", "parse_address"]


def _chunks(n: int, size: int = P.MAX_BATCH) -> Iterator[slice]:
    for start in range(0, n, size):
        yield slice(start, min(n, start + size))


def _byte_chunks(sizes: Sequence[int], max_bytes: int) -> Iterator[slice]:
    """Slices of at most ``MAX_BATCH`` items and ``max_bytes`` bytes (one item alone may be
    larger: the daemon then answers StoreFull)."""
    start, total = 0, 0
    for i, s in enumerate(sizes):
        if i > start and (i - start == P.MAX_BATCH or total + s > max_bytes):
            yield slice(start, i)
            start, total = i, 0
        total += s
    if start < len(sizes):
        yield slice(start, len(sizes))


def _path(conn: Connection) -> str:
    return "shm" if conn.arena is not None else "ucx" if conn.ucx is not None else "tcp"


class Client:
    """A connection to one store node. See the module docstring for paths and failures."""

    def __init__(self, address: str, *, auth_token: str | None = None, timeout: float = 5.0,
                 transport: Transport = "auto",
                 tls: tls_settings.TLSConfig | Literal[False] | None = None,
                 shared_index: bool = True) -> None:
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be 'auto', 'tcp', 'shm' or 'ucx', got {transport!r}")
        parse_address(address)  # a malformed address fails here, not on first use
        self.address = address
        if auth_token is None:  # the cluster secret of the environment (kvstore.secret), else
            auth_token = secret.resolve() or os.environ.get("KVSTORE_AUTH_TOKEN")  # the old name
        self._token = auth_token
        self.tls: tls_settings.TLSConfig | None = tls_settings.current() if tls is None else (tls or None)
        if transport == "ucx":
            reason = "TLS is on (UCX moves bytes unencrypted)" if self.tls else ucx.available()
            if reason is not None:
                raise ValueError(f"transport='ucx' cannot be used: {reason}")
        self._timeout = timeout
        self._want = transport
        self._use_index = shared_index
        self._lock = threading.RLock()
        self._conn: Connection | None = None
        self._cuda: cuda_path.Link | None = None  # the daemon's GPU tier, mapped for _conn
        self._closed = False
        self._traffic = Traffic()
        with self._lock:
            self._connection()

    # --- public API ----------------------------------------------------------------------

    @property
    def transport(self) -> str:
        """``"shm"``, ``"ucx"`` or ``"tcp"``: the path of the current connection."""
        with self._lock:
            return _path(self._connection())

    @property
    def index_reads(self) -> bool:
        """Whether gets of plain buffers read the daemon's shared-memory index first."""
        with self._lock:
            return self._connection().index is not None

    @property
    def node_id(self) -> str:
        with self._lock:
            return self._connection().hello["node_id"]

    @property
    def bytes_sent(self) -> int:
        """Every byte this client wrote to its sockets."""
        return self._traffic.sent

    @property
    def bytes_received(self) -> int:
        """... and read from them."""
        return self._traffic.received

    @property
    def map_attempts(self) -> int:
        """How often this client tried to map a daemon's shared-memory arena: only when the
        daemon's HELLO said it runs on this host (a failed mapping falls back to TCP, so a
        test that no mapping crosses hosts reads this, not ``transport``)."""
        return self._traffic.map_attempts

    @property
    def index_hits(self) -> int:
        """Blocks the daemon's shared-memory index served with no request (across reconnects)."""
        return self._traffic.index_hits

    def put(self, keys: Sequence[bytes], values: Sequence[Any]) -> list[bool]:
        """Store ``values[i]`` under ``keys[i]``; per key, whether it was stored (now, or
        already present: a successful no-op; a cache may evict it later). A store too full for
        the whole batch stores its longest leading run that fits and answers False from the
        first key that did not fit on (a KV block is worth keeping only with its prefix);
        nothing of a part that failed is left behind."""
        if len(keys) != len(values):
            raise ValueError(f"{len(keys)} keys but {len(values)} values")
        srcs = [source_parts(v) for v in values]
        with self._lock:
            max_bytes = int(self._connection().hello.get("max_data", P.MAX_DATA))
        held = [False] * len(keys)
        for sl in _byte_chunks([sum(p.nbytes for p in ps) for ps in srcs], max_bytes):
            n = self._put_leading(keys, srcs, sl.start, sl.stop)
            held[sl.start:sl.start + n] = [True] * n
            if n < sl.stop - sl.start:
                break
        return held

    def _put_leading(self, keys: Sequence[bytes], srcs: list[list[np.ndarray]], lo: int,
                     hi: int) -> int:
        """Put ``keys[lo:hi]`` (one request, stored or not as a whole); when the store is
        full, the longest leading run that fits, found by halving (log2 requests). Returns
        how many leading keys are stored."""
        try:
            with self._request() as conn:
                if conn.arena is not None:
                    shm_path.put(conn, keys[lo:hi], srcs[lo:hi])
                elif conn.ucx is not None:
                    ucx_path.put(conn, keys[lo:hi], srcs[lo:hi], self._timeout)
                else:
                    tcp_path.put(conn, keys[lo:hi], srcs[lo:hi])
            return hi - lo
        except StoreFull:
            if hi - lo == 1:
                return 0
        mid = (lo + hi) // 2
        n = self._put_leading(keys, srcs, lo, mid)
        return n if n < mid - lo else n + self._put_leading(keys, srcs, mid, hi)

    def get(self, keys: Sequence[bytes], buffers: Sequence[Any]) -> list[bool]:
        """Copy each present block into its buffer; return which keys were found."""
        if len(keys) != len(buffers):
            raise ValueError(f"{len(keys)} keys but {len(buffers)} buffers")
        conn = self._conn
        if conn is not None and conn.index is not None and 0 < len(keys) <= P.MAX_BATCH:
            fast = self._get_indexed(conn, keys, buffers)
            if fast is not None:
                return fast
        dests = [Dest(b) for b in buffers]
        found: list[bool] = []
        for sl in _chunks(len(keys)):
            with self._request() as conn:
                if conn.arena is not None:
                    found += shm_path.get(conn, keys[sl], dests[sl])
                elif conn.ucx is not None:
                    found += ucx_path.get(conn, keys[sl], dests[sl], self._timeout)
                else:
                    found += tcp_path.get(conn, keys[sl], dests[sl])
        return found

    def get_bytes(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """Each block as ``bytes`` (None when absent). Convenient; ``get`` copies less."""
        out: list[bytes | None] = []
        for sl in _chunks(len(keys)):
            with self._request() as conn:
                if conn.arena is not None:
                    out += shm_path.read(conn, keys[sl])
                    continue
                if conn.ucx is not None:
                    out += ucx_path.read(conn, keys[sl], self._timeout)
                    continue
                out += tcp_path.read(conn, keys[sl])
        return out

    def get_cuda(self, keys: Sequence[bytes], tensors: Sequence[Any]) -> list[bool]:
        """``get`` into contiguous CUDA tensors, device to device from the daemon's GPU tier
        over CUDA IPC (``kvstore.client.cuda_path``); keys not in the GPU tier are read by
        ``get`` (host paths, a staging copy). Which were found. ``Unsupported`` where CUDA IPC
        is not possible: no CUDA here, or a daemon without a CUDA GPU tier on this host."""
        torch = cuda_ipc.require_cuda()
        if len(keys) != len(tensors):
            raise ValueError(f"{len(keys)} keys but {len(tensors)} tensors")
        dsts = [cuda_path.flat(torch, t, i) for i, t in enumerate(tensors)]
        found: list[bool] = []
        for sl in _chunks(len(keys)):
            with self._request() as conn:
                self._cuda = cuda_path.link(conn, self._cuda)
                found += cuda_path.get(conn, self._cuda, keys[sl], dsts[sl])
        rest = [i for i, f in enumerate(found) if not f]
        if rest:
            for i, f in zip(rest, self.get([keys[i] for i in rest], [tensors[i] for i in rest])):
                found[i] = f
        return found

    def put_cuda(self, keys: Sequence[bytes], tensors: Sequence[Any]) -> list[bool]:
        """``put`` of contiguous CUDA tensors straight into the daemon's GPU tier over CUDA
        IPC, device to device (``kvstore.client.cuda_path``); per key, whether it is stored
        (now, or already present). A part the GPU tier cannot fit goes through ``put``.
        ``Unsupported`` as for ``get_cuda``."""
        torch = cuda_ipc.require_cuda()
        if len(keys) != len(tensors):
            raise ValueError(f"{len(keys)} keys but {len(tensors)} tensors")
        srcs = [cuda_path.flat(torch, t, i) for i, t in enumerate(tensors)]
        with self._request() as conn:
            self._cuda = cuda_path.link(conn, self._cuda)
            cap = self._cuda.max_reserve
        held: list[bool] = []
        for sl in _byte_chunks([s.numel() for s in srcs], cap):
            try:
                with self._request() as conn:
                    self._cuda = cuda_path.link(conn, self._cuda)
                    cuda_path.put(conn, self._cuda, keys[sl], srcs[sl])
                held += [True] * (sl.stop - sl.start)
            except StoreFull:
                held += self.put(keys[sl], tensors[sl])
        return held

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        out: list[bool] = []
        for sl in _chunks(len(keys)):
            with self._request() as conn:
                _, meta = conn.exchange(P.Op.CONTAINS, P.pack_keys(keys[sl]), expect=sl.stop - sl.start)
                out += [bool(b) for b in meta]
        return out

    def prefix_len(self, keys: Sequence[bytes]) -> int:
        """How many leading keys are stored (the longest cached prefix, in blocks)."""
        total = 0
        for sl in _chunks(len(keys)):
            n = self._count(P.Op.PREFIX_LEN, keys[sl])
            total += n
            if n < sl.stop - sl.start:
                break
        return total

    def delete(self, keys: Sequence[bytes]) -> int:
        """Delete blocks (pinned ones go once unpinned); return how many were present."""
        return sum(self._count(P.Op.DELETE, keys[sl]) for sl in _chunks(len(keys)))

    def stats(self) -> dict[str, Any]:
        """``{"store": <BlockStore.stats() fields>, "server": {node_id, address, ...}}``."""
        with self._request() as conn:
            _, meta = conn.exchange(P.Op.STATS, b"")
        return P.unpack_json(meta)

    def close(self) -> None:
        """Report the index's pending reads (waiting for the daemon to take them) and close."""
        with self._lock:
            if self._conn is not None and not self._closed:
                try:
                    self._conn.report_touches()
                except (OSError, EOFError, KVStoreError):
                    pass
            self._closed = True
            self._drop()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("disconnected" if self._conn is None else
                                               _path(self._conn))
        return f"Client({self.address!r}, {state})"

    # --- data paths ------------------------------------------------------------------------

    def _count(self, op: P.Op, keys) -> int:
        """A request whose answer is one u32 (PREFIX_LEN, DELETE)."""
        with self._request() as conn:
            _, meta = conn.exchange(op, P.pack_keys(keys), expect=4)
        return P._U32.unpack(meta)[0]

    def _get_indexed(self, conn: Connection, keys, buffers) -> list[bool] | None:
        """``get`` of plain buffers through the index (``shm_path.read_plain``); None: take
        the general path."""
        with self._lock:
            if self._conn is not conn:
                return None
            done = shm_path.read_plain(conn, keys, buffers)
            if done is None:
                return None
            found, rest = done
            if rest or conn.touch_due():
                with self._request() as c:
                    if rest:
                        shm_path.pin_rest(c, keys, buffers, rest, found)
                    else:
                        c.flush_touches()
            return found

    # --- connection ------------------------------------------------------------------------

    @contextmanager
    def _request(self) -> Iterator[Connection]:
        """Hold the lock and a live connection; map socket failures to ``StoreUnavailable``
        and drop the connection whenever the stream may be out of step."""
        with self._lock:
            conn = self._connection()
            try:
                yield conn
            except (ProtocolError, AuthError):
                self._drop()
                raise
            except (OSError, EOFError) as e:  # ConnectionError and socket timeouts included
                self._drop()
                raise StoreUnavailable(f"lost the kvstore daemon at {self.address}: {e!r}; the "
                                       "operation may not have happened, retry or treat as a miss") from None
            except KVStoreError:
                raise  # a complete error answer (StoreFull, CorruptBlock): the stream is in step
            except BaseException:
                self._drop()  # anything else may have left a frame half read or written
                raise

    def _connection(self) -> Connection:
        if self._closed:
            raise StoreUnavailable(f"this Client for {self.address} is closed; create a new one")
        if self._conn is None:
            self._conn = Connection.open(self.address, token=self._token, timeout=self._timeout,
                                         want=self._want, traffic=self._traffic,
                                         tls=self.tls.client_context() if self.tls else None,
                                         use_index=self._use_index)
        return self._conn

    def _drop(self) -> None:
        self._cuda = None  # its mapping is the old connection's
        if self._conn is not None:
            conn, self._conn = self._conn, None
            try:
                conn.close()
            except OSError:
                pass

