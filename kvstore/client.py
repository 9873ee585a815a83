"""``Client``: one store node, over shared memory on the same host, TCP elsewhere.

The path is chosen at connect time: when the daemon's HELLO reports this machine's host id
and its arena can be mapped (``Arena.attach``), gets are PIN + copy from the mapped arena +
UNPIN and puts are RESERVE + write in place + COMMIT, so only keys and offsets cross the
socket. Otherwise values travel in PUT/GET frames (``kvstore.protocol``), received straight
into the caller's buffers. ``transport="tcp"`` forces the socket path.

Buffers: anything with the buffer protocol (bytes, bytearray, memoryview, NumPy arrays) and
torch tensors (CPU tensors in place through a uint8 view; a CUDA tensor through a CPU
staging copy). Tensors are recognized by duck typing (``.is_cuda``); torch is imported only
when a tensor is passed. A get's buffer must be C-contiguous, writable and at least as
large as the block; the block fills its head.

Failure: a refused connection, a connect or I/O timeout or a dropped connection raises
``StoreUnavailable`` at once (``timeout`` bounds every connect and every socket wait; never
a hang); the next call reconnects. Daemon-side errors come back as the typed exceptions of
``kvstore.errors``.

Threads: a ``Client`` is thread-safe (one lock around each request; requests from several
threads are serialized on its one connection). For parallel transfers use one ``Client``
per thread, or ``AsyncClient``, which keeps one per worker thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import os
import socket
import threading
from contextlib import contextmanager
from typing import Any, Iterator, Literal, Sequence

import numpy as np

from . import protocol as P
from .arena import Arena
from .errors import AuthError, KVStoreError, ProtocolError, StoreFull, StoreUnavailable
from .keys import BlockKey

__all__ = ["Client", "AsyncClient", "connect", "parse_address"]

Transport = Literal["auto", "tcp", "shm"]


def parse_address(address: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` for IPv6) as a tuple."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"store address must be host:port, got {address!r}")
    return host.strip("[]"), int(port)


def connect(address: str | None = None, *, etcd: str | None = None, cluster: str = "kvstore",
            auth_token: str | None = None, timeout: float = 5.0):
    """A ``Client`` for one node at ``address``, or a ``ClusterClient`` over the nodes
    registered in etcd at ``etcd`` (endpoints URL) under ``cluster``. Pass exactly one."""
    if (address is None) == (etcd is None):
        raise ValueError("pass exactly one of address='host:port' or etcd='http://host:port'")
    if address is not None:
        return Client(address, auth_token=auth_token, timeout=timeout)
    from .cluster import ClusterClient

    return ClusterClient(etcd, cluster=cluster, auth_token=auth_token, timeout=timeout)


# --- buffers ---------------------------------------------------------------------------------


def _tensor_bytes(t) -> np.ndarray:
    import torch

    if not t.is_contiguous():
        raise ValueError("tensor buffers must be contiguous; call .contiguous() first")
    return t.detach().reshape(-1).view(torch.uint8).numpy()


def _source(value) -> np.ndarray:
    """A read-only flat uint8 view of a value to put (CUDA tensors are staged to CPU)."""
    if hasattr(value, "is_cuda"):
        t = value.detach()
        return _tensor_bytes(t.cpu() if t.is_cuda else t.contiguous())
    if isinstance(value, np.ndarray):
        return np.ascontiguousarray(value).reshape(-1).view(np.uint8)
    try:
        return np.frombuffer(memoryview(value).cast("B"), np.uint8)
    except TypeError:
        raise ValueError(f"cannot put a {type(value).__name__}: pass bytes-like, a NumPy array "
                         "or a torch tensor (C-contiguous)") from None


class _Dest:
    """A writable flat uint8 view of a get buffer; CUDA tensors get a CPU staging buffer
    that ``finish()`` copies to the device."""

    __slots__ = ("array", "_cuda")

    def __init__(self, buf) -> None:
        self._cuda = None
        if hasattr(buf, "is_cuda"):
            if buf.is_cuda:
                import torch

                if not buf.is_contiguous():
                    raise ValueError("tensor buffers must be contiguous")
                self._cuda = buf
                self.array = torch.empty(buf.nbytes, dtype=torch.uint8, pin_memory=True).numpy()
            else:
                self.array = _tensor_bytes(buf)
        elif isinstance(buf, np.ndarray):
            if not buf.flags.c_contiguous or not buf.flags.writeable:
                raise ValueError("NumPy get buffers must be C-contiguous and writable")
            self.array = buf.reshape(-1).view(np.uint8)
        else:
            try:
                mv = memoryview(buf).cast("B")
            except TypeError:
                raise ValueError(f"cannot get into a {type(buf).__name__}: pass a writable "
                                 "bytes-like object, NumPy array or torch tensor") from None
            if mv.readonly:
                raise ValueError(f"get buffer of type {type(buf).__name__} is read-only")
            self.array = np.frombuffer(mv, np.uint8)

    def finish(self, nbytes: int) -> None:
        if self._cuda is not None:
            import torch

            flat = self._cuda.reshape(-1).view(torch.uint8)
            flat[:nbytes].copy_(torch.from_numpy(self.array[:nbytes]), non_blocking=False)


def _chunks(n: int, size: int = P.MAX_BATCH) -> Iterator[slice]:
    for start in range(0, n, size):
        yield slice(start, min(n, start + size))


# --- the client --------------------------------------------------------------------------------


class _Conn:
    __slots__ = ("sock", "hello", "arena", "arena_np", "rid", "hdr")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.hello: dict[str, Any] = {}
        self.arena: Arena | None = None
        self.arena_np: np.ndarray | None = None
        self.rid = 0
        self.hdr = memoryview(bytearray(P.HEADER_SIZE))

    def close(self) -> None:
        self.arena_np = None
        if self.arena is not None:
            self.arena.close()
        self.sock.close()


class Client:
    """A connection to one store node. See the module docstring for paths and failures."""

    def __init__(self, address: str, *, auth_token: str | None = None, timeout: float = 5.0,
                 transport: Transport = "auto") -> None:
        if transport not in ("auto", "tcp", "shm"):
            raise ValueError(f"transport must be 'auto', 'tcp' or 'shm', got {transport!r}")
        self.address = address
        self._addr = parse_address(address)
        self._token = auth_token if auth_token is not None else os.environ.get("KVSTORE_AUTH_TOKEN")
        self._timeout = timeout
        self._want = transport
        self._lock = threading.RLock()
        self._conn: _Conn | None = None
        self._closed = False
        self.bytes_sent = 0       # every byte this client wrote to its socket
        self.bytes_received = 0   # ... and read from it
        with self._lock:
            self._connection()

    # --- public API ----------------------------------------------------------------------

    @property
    def transport(self) -> str:
        """``"shm"`` or ``"tcp"``: the path of the current connection."""
        with self._lock:
            return "shm" if self._connection().arena is not None else "tcp"

    @property
    def node_id(self) -> str:
        with self._lock:
            return self._connection().hello["node_id"]

    def put(self, keys: Sequence[bytes], values: Sequence[Any]) -> None:
        """Store ``values[i]`` under ``keys[i]``. Present keys are a successful no-op.
        Raises ``StoreFull`` if the batch cannot fit (nothing of that batch is stored)."""
        if len(keys) != len(values):
            raise ValueError(f"{len(keys)} keys but {len(values)} values")
        srcs = [_source(v) for v in values]
        for sl in _chunks(len(keys)):
            with self._request() as conn:
                if conn.arena is not None:
                    self._put_shm(conn, keys[sl], srcs[sl])
                else:
                    self._put_tcp(conn, keys[sl], srcs[sl])

    def get(self, keys: Sequence[bytes], buffers: Sequence[Any]) -> list[bool]:
        """Copy each present block into its buffer; return which keys were found."""
        if len(keys) != len(buffers):
            raise ValueError(f"{len(keys)} keys but {len(buffers)} buffers")
        dests = [_Dest(b) for b in buffers]
        found: list[bool] = []
        for sl in _chunks(len(keys)):
            with self._request() as conn:
                if conn.arena is not None:
                    found += self._get_shm(conn, keys[sl], dests[sl])
                else:
                    found += self._get_tcp(conn, keys[sl], dests[sl])
        return found

    def get_bytes(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """Each block as ``bytes`` (None when absent). Convenient; ``get`` copies less."""
        out: list[bytes | None] = []
        for sl in _chunks(len(keys)):
            with self._request() as conn:
                _, meta = self._exchange(conn, P.Op.PIN if conn.arena is not None else P.Op.GET,
                                         P.pack_keys(keys[sl]), keep_data=True)
                if conn.arena is not None:
                    out += self._read_pinned(conn, keys[sl], meta)
                else:
                    for size in np.frombuffer(meta, "<u8").tolist():
                        if size == P.MISSING:
                            out.append(None)
                        else:
                            buf = bytearray(size)
                            self._recv(conn, memoryview(buf))
                            out.append(bytes(buf))
        return out

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        out: list[bool] = []
        for sl in _chunks(len(keys)):
            with self._request() as conn:
                _, meta = self._exchange(conn, P.Op.CONTAINS, P.pack_keys(keys[sl]))
                out += [bool(b) for b in meta]
        return out

    def prefix_len(self, keys: Sequence[bytes]) -> int:
        """How many leading keys are stored (the longest cached prefix, in blocks)."""
        total = 0
        for sl in _chunks(len(keys)):
            with self._request() as conn:
                _, meta = self._exchange(conn, P.Op.PREFIX_LEN, P.pack_keys(keys[sl]))
            n = P._U32.unpack(meta)[0]
            total += n
            if n < sl.stop - sl.start:
                break
        return total

    def delete(self, keys: Sequence[bytes]) -> int:
        """Delete blocks (pinned ones go once unpinned); return how many were present."""
        total = 0
        for sl in _chunks(len(keys)):
            with self._request() as conn:
                _, meta = self._exchange(conn, P.Op.DELETE, P.pack_keys(keys[sl]))
            total += P._U32.unpack(meta)[0]
        return total

    def stats(self) -> dict[str, Any]:
        """``{"store": <BlockStore.stats() fields>, "server": {node_id, address, ...}}``."""
        with self._request() as conn:
            _, meta = self._exchange(conn, P.Op.STATS, b"")
        return P.unpack_json(meta)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._drop()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("disconnected" if self._conn is None else
                                               ("shm" if self._conn.arena is not None else "tcp"))
        return f"Client({self.address!r}, {state})"

    # --- data paths ------------------------------------------------------------------------

    def _put_tcp(self, conn: _Conn, keys, srcs: list[np.ndarray]) -> None:
        sizes = [s.nbytes for s in srcs]
        total = sum(sizes)
        if total > conn.hello["max_data"]:
            raise StoreFull(f"a put of {total} bytes exceeds the node's {conn.hello['max_data']}"
                            "-byte arena; put fewer blocks at once or raise its --memory")
        self._exchange(conn, P.Op.PUT, P.pack_keys_sizes(keys, sizes), srcs)

    def _put_shm(self, conn: _Conn, keys, srcs: list[np.ndarray]) -> None:
        _, meta = self._exchange(conn, P.Op.RESERVE, P.pack_keys_sizes(keys, [s.nbytes for s in srcs]))
        offsets = np.frombuffer(meta, "<u8").tolist()
        mine = [k for k, off in zip(keys, offsets) if off != P.MISSING]
        arena = conn.arena_np
        try:
            for src, off in zip(srcs, offsets):
                if off != P.MISSING:
                    np.copyto(arena[off: off + src.nbytes], src)
        except BaseException:
            if mine:
                self._exchange(conn, P.Op.ABORT, P.pack_keys(mine))
            raise
        if mine:
            self._exchange(conn, P.Op.COMMIT, P.pack_keys(mine))

    def _get_tcp(self, conn: _Conn, keys, dests: list[_Dest]) -> list[bool]:
        h, meta = self._exchange(conn, P.Op.GET, P.pack_keys(keys), keep_data=True)
        sizes = np.frombuffer(meta, "<u8").tolist()
        too_big = [(i, s) for i, s in enumerate(sizes)
                   if s != P.MISSING and s > dests[i].array.nbytes]
        if too_big:
            self._drain(conn, h.data_len)
            i, s = too_big[0]
            raise ValueError(f"buffer {i} holds {dests[i].array.nbytes} bytes, its block is {s}")
        for d, s in zip(dests, sizes):
            if s != P.MISSING:
                self._recv(conn, memoryview(d.array[:s]))
                d.finish(s)
        return [s != P.MISSING for s in sizes]

    def _get_shm(self, conn: _Conn, keys, dests: list[_Dest]) -> list[bool]:
        _, meta = self._exchange(conn, P.Op.PIN, P.pack_keys(keys))
        n = len(keys)
        arr = np.frombuffer(meta, "<u8")
        offsets, sizes = arr[:n].tolist(), arr[n:].tolist()
        pinned = [k for k, s in zip(keys, sizes) if s != P.MISSING]
        arena = conn.arena_np
        try:
            for i, (d, off, s) in enumerate(zip(dests, offsets, sizes)):
                if s == P.MISSING:
                    continue
                if s > d.array.nbytes:
                    raise ValueError(f"buffer {i} holds {d.array.nbytes} bytes, its block is {s}")
                np.copyto(d.array[:s], arena[off: off + s])
                d.finish(s)
        finally:
            if pinned:
                self._send_unpin(conn, pinned)
        return [s != P.MISSING for s in sizes]

    def _read_pinned(self, conn: _Conn, keys, meta) -> list[bytes | None]:
        n = len(keys)
        arr = np.frombuffer(meta, "<u8")
        offsets, sizes = arr[:n].tolist(), arr[n:].tolist()
        pinned = [k for k, s in zip(keys, sizes) if s != P.MISSING]
        try:
            return [None if s == P.MISSING else conn.arena.buf[off: off + s].tobytes()
                    for off, s in zip(offsets, sizes)]
        finally:
            if pinned:
                self._send_unpin(conn, pinned)

    def _send_unpin(self, conn: _Conn, keys) -> None:
        """UNPIN without waiting: the daemon applies it before this connection's next request
        and answers only if it fails (then the next response is out of step and the
        connection is dropped)."""
        conn.rid += 1
        meta = P.pack_keys(keys)
        conn.sock.sendall(P.pack_header(P.Op.UNPIN, P.FLAG_NO_REPLY, conn.rid, len(meta)) + meta)
        self.bytes_sent += P.HEADER_SIZE + len(meta)

    # --- connection and framing --------------------------------------------------------------

    @contextmanager
    def _request(self) -> Iterator[_Conn]:
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

    def _connection(self) -> _Conn:
        if self._closed:
            raise StoreUnavailable(f"this Client for {self.address} is closed; create a new one")
        if self._conn is None:
            self._conn = self._open()
        return self._conn

    def _open(self) -> _Conn:
        try:
            sock = socket.create_connection(self._addr, timeout=self._timeout)
        except OSError as e:
            raise StoreUnavailable(f"cannot reach a kvstore daemon at {self.address} ({e}); "
                                   "check that `kvstore serve` runs there and is reachable") from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(self._timeout)
        conn = _Conn(sock)
        try:
            _, meta = self._exchange(conn, P.Op.HELLO, P.pack_json(
                {"token": self._token, "host_id": P.local_host_id(), "pid": os.getpid()}))
            conn.hello = P.unpack_json(meta)
        except (OSError, EOFError) as e:
            sock.close()
            raise StoreUnavailable(f"kvstore daemon at {self.address} dropped the handshake "
                                   f"({e!r}); is it a kvstore daemon, and is it overloaded?") from None
        except BaseException:
            sock.close()
            raise
        if self._want != "tcp":
            self._attach(conn)
        return conn

    def _attach(self, conn: _Conn) -> None:
        arena = conn.hello.get("arena")
        same_host = conn.hello.get("host_id") == P.local_host_id()
        if arena and same_host:
            try:
                mapped = Arena.attach(arena["name"])
                if mapped.size != arena["size"]:
                    mapped.close()
                else:
                    conn.arena = mapped
                    conn.arena_np = np.frombuffer(mapped.buf, np.uint8)
            except (OSError, ValueError):
                pass
        if conn.arena is None and self._want == "shm":
            conn.close()
            raise StoreUnavailable(f"transport='shm' but the arena of {self.address} cannot be "
                                   "mapped here (another host?); use transport='auto' or 'tcp'")

    def _drop(self) -> None:
        if self._conn is not None:
            conn, self._conn = self._conn, None
            try:
                conn.close()
            except OSError:
                pass

    def _recv(self, conn: _Conn, view: memoryview) -> None:
        P.recv_exact(conn.sock, view)
        self.bytes_received += view.nbytes

    def _drain(self, conn: _Conn, nbytes: int) -> None:
        P.drain(conn.sock, nbytes, memoryview(bytearray(min(nbytes, 1 << 20) or 1)))
        self.bytes_received += nbytes

    def _exchange(self, conn: _Conn, op: P.Op, meta: bytes, data: list | None = None,
                  keep_data: bool = False) -> tuple[P.Header, memoryview]:
        """Send one request and read its response header and meta. With ``keep_data`` the
        response's data is left on the socket for the caller to read."""
        conn.rid += 1
        data_len = sum(d.nbytes for d in data) if data else 0
        head = P.pack_header(op, 0, conn.rid, len(meta), data_len)
        if data:
            P.send_buffers(conn.sock, [head, meta, *data])
        else:
            conn.sock.sendall(head + meta)
        self.bytes_sent += P.HEADER_SIZE + len(meta) + data_len
        self._recv(conn, conn.hdr)
        h = P.unpack_header(conn.hdr)
        if h.request_id != conn.rid or h.op != op or not h.flags & P.FLAG_RESPONSE:
            raise ProtocolError(f"response (op {h.op}, id {h.request_id}) does not answer "
                                f"request (op {int(op)}, id {conn.rid})")
        rmeta = memoryview(bytearray(h.meta_len))
        self._recv(conn, rmeta)
        if h.flags & P.FLAG_ERROR:
            raise P.error_from_meta(rmeta)
        if h.data_len and not keep_data:
            self._drain(conn, h.data_len)
        return h, rmeta


class AsyncClient:
    """asyncio face of ``Client``: each call runs a sync ``Client`` in a worker thread.

    Why not a native asyncio protocol: the data path is a memcpy (shared memory) or a
    ``recv_into`` the caller's buffer, both of which release the GIL in a thread; asyncio's
    stream layer would add a copy per frame and a second implementation of the protocol.
    Each of the ``concurrency`` worker threads owns one ``Client`` (one connection), so that
    many calls run in parallel and the event loop never blocks.
    """

    def __init__(self, address: str, *, auth_token: str | None = None, timeout: float = 5.0,
                 transport: Transport = "auto", concurrency: int = 4) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        self.address = address
        self._kwargs = dict(auth_token=auth_token, timeout=timeout, transport=transport)
        self._pool = concurrent.futures.ThreadPoolExecutor(concurrency, "kvstore-async")
        self._local = threading.local()
        self._clients: list[Client] = []
        self._lock = threading.Lock()

    def _client(self) -> Client:
        c = getattr(self._local, "client", None)
        if c is None:
            c = self._local.client = Client(self.address, **self._kwargs)
            with self._lock:
                self._clients.append(c)
        return c

    async def _run(self, method: str, *args: Any) -> Any:
        def call() -> Any:
            return getattr(self._client(), method)(*args)

        return await asyncio.get_running_loop().run_in_executor(self._pool, call)

    async def put(self, keys, values) -> None:
        return await self._run("put", keys, values)

    async def get(self, keys, buffers) -> list[bool]:
        return await self._run("get", keys, buffers)

    async def get_bytes(self, keys) -> list[bytes | None]:
        return await self._run("get_bytes", keys)

    async def contains(self, keys) -> list[bool]:
        return await self._run("contains", keys)

    async def prefix_len(self, keys) -> int:
        return await self._run("prefix_len", keys)

    async def delete(self, keys) -> int:
        return await self._run("delete", keys)

    async def stats(self) -> dict[str, Any]:
        return await self._run("stats")

    async def close(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self._shutdown)

    def _shutdown(self) -> None:
        self._pool.shutdown(wait=True)
        with self._lock:
            for c in self._clients:
                c.close()
            self._clients.clear()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
