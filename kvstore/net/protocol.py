"""The kvstore wire protocol: framed binary messages over one TCP connection.

Every message, request or response, is one frame (all integers little-endian)::

    offset size  field
    0      4     magic        b"KVSP"
    4      1     version      1
    5      1     op           see ``Op``
    6      2     flags        bit 0 RESPONSE, bit 1 ERROR, bit 2 NO_REPLY, bit 3 UCX
    8      8     request id   chosen by the client, echoed in the response
    16     4     meta length  bytes of structured metadata that follow the header
    20     4     reserved     0
    24     8     data length  bytes of bulk block payload that follow the metadata
    32     ...   meta, then data

``meta`` holds keys, sizes and statuses; ``data`` is block values concatenated in key
order, so the daemon can ``recv_into`` each value straight into its reserved arena slot and
send each value straight from its pinned slot (no intermediate copy on either side).

Requests are answered strictly in order, one response per request, with the same op and
request id and the RESPONSE flag, except an UNPIN or TOUCH sent with NO_REPLY: it gets no
response (a PIN-path get is then one round trip, PIN, plus a one-way UNPIN that the daemon
applies before the connection's next request). A NO_REPLY request that fails is answered
with an error frame and the connection is closed. Below, ``keys`` is ``u32 n`` then ``n`` 16-byte keys and
``sizes`` is ``n`` u64; ``MISSING`` (2**64-1) marks an absent entry in a u64 array.

==========  ==========================================  =====================================
op          request meta / data                         response meta / data
==========  ==========================================  =====================================
HELLO 1     JSON {"token", "host_id" (hex), "pid"}      JSON {"node_id", "host_id", "arena":
                                                        {"name", "size"}, "max_batch",
                                                        "max_data"[, "index": {"name",
                                                        "size", "instance", "slots"}]}
PUT 2       keys, sizes / the values                    n u8 (1 stored, 0 already present)
GET 3       keys                                        sizes (MISSING if absent) / the
                                                        present values in key order
CONTAINS 4  keys                                        n u8
PREFIX_LEN 5 keys                                       u32
DELETE 6    keys                                        u32 (blocks deleted)
STATS 7     (empty)                                     JSON: the store's and server's stats
RESERVE 8   keys, sizes                                 n u64 arena offsets (MISSING: already
                                                        present, nothing to write)
COMMIT 9    keys (reserved by this connection)          (empty)
ABORT 10    keys (reserved by this connection)          (empty)
PIN 11      keys                                        n u64 offsets, then sizes (MISSING
                                                        if absent)
UNPIN 12    keys (pinned by this connection)            (empty)
TOUCH 13    keys, n u32 read counts, n u64 sizes        (empty)
UCX 14      JSON {"address", "prefix"}                  JSON {"address", "prefix"}
GPU_HANDLE 15 (empty)                                   JSON: the GPU tier's CUDA IPC handle
GPU_PIN 16  keys                                        n u64 tier offsets, then sizes
                                                        (MISSING if not in the GPU tier)
GPU_UNPIN 17 keys (GPU-pinned by this connection)       (empty)
GPU_RESERVE 18 keys, sizes                              n u64 tier offsets (MISSING: present)
GPU_COMMIT 19 keys (GPU-reserved by this connection)    (empty)
GPU_ABORT 20 keys (GPU-reserved by this connection)     (empty)
==========  ==========================================  =====================================

GPU_* (15-20) are the same-host CUDA IPC path (``kvstore.node.gpu_share``): HELLO's answer
says ``"cuda_ipc": true`` when the daemon has a CUDA GPU tier and the HELLO's host id is its
own; the client opens the one handle per connection and copies blocks device to device at the
offsets, as RESERVE/COMMIT/ABORT/PIN/UNPIN do in the arena (pins and reservations are the
connection's, released when it ends). Where it is not offered they answer UNSUPPORTED and the
connection goes on.

RESERVE/COMMIT/ABORT/PIN/UNPIN are the same-host shared-memory path: the client maps the
daemon's arena (named in the HELLO response; used only when the HELLO host ids match and the
mapping succeeds), writes or reads block bytes in place, and only keys and offsets cross the
socket. Whatever a connection has reserved or pinned is released when it closes or dies.

The shared-memory index (``kvstore.node.shared_index``, its docstring the layout's spec),
named by HELLO's ``"index"`` when the daemon publishes one, lets a same-host client read a
committed host block out of the mapped arena with no request at all, under a per-slot seqlock;
anything it does not settle is asked with PIN. Such reads are reported afterwards with TOUCH
(usually NO_REPLY, batched): keys in the order they were read, the oldest first (a batch's
tail before its head), each with how often and how many bytes: recency and the hit counters.

The first frame of a connection must be HELLO; with a daemon auth token (the cluster secret,
``kvstore.secret``) the client's token must match, otherwise the daemon answers an AUTH error
and closes the connection. Before HELLO succeeds the daemon holds at most ``HEADER_SIZE +
MAX_HELLO_META`` bytes for the connection and tells it nothing (no node id, no arena).

UCX and ``FLAG_UCX`` (bit 3, on GET and RESERVE) are the UCX data path, block bytes as tagged
UCX messages instead of frame data; ``kvstore.net.ucx``'s docstring is their spec.

Request id 0 is the daemon's: an error frame with request id 0 is about the connection, not
a request (a bad header, or a daemon that cannot take the connection: at its connection
limit or out of file descriptors it answers UNAVAILABLE before any request and closes).

Errors: a response with the ERROR flag carries ``u16 code`` then a UTF-8 message; the client
raises the matching exception of ``kvstore.errors`` (``ErrorCode``), never an integer.
A PUT that cannot fit fails as a whole with STORE_FULL and leaves nothing reserved.

Limits: meta at most ``MAX_META`` bytes, at most ``MAX_BATCH`` keys per frame, data at most
``MAX_DATA`` bytes and only on PUT requests. A request's meta is checked against its op's
limit (``meta_limit``: the largest meta the op can carry, ``MAX_HELLO_META`` for HELLO, 0 for
STATS) from the header alone, before anything is read or allocated. A PUT (or a RESERVE,
with what the connection already holds reserved) larger than the HELLO response's
``max_data`` (the daemon's per-connection cap on in-flight reservations) fails with
STORE_FULL; clients split puts to fit it. Bad input — wrong magic or version, an unknown op, an absurd length, a malformed
meta, sizes that do not add up to the data length, a truncated frame (EOF or an I/O timeout
mid-frame, or a frame not complete within the daemon's frame deadline) — gets a PROTOCOL error frame where the stream is still readable, and the daemon
then closes that one connection, releasing its reservations and pins. Every other connection
is unaffected.
"""

from __future__ import annotations

import json
import socket
import ssl
import struct
from enum import IntEnum
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np

from kvstore.errors import (AuthError, CorruptBlock, KVStoreError, ProtocolError, StoreFull,
                            StoreUnavailable, Unsupported)
from kvstore.keys import KEY_BYTES, BlockKey

__all__ = [
    "MAGIC", "VERSION", "HEADER", "HEADER_SIZE", "MAX_META", "MAX_BATCH", "MAX_DATA", "MISSING",
    "FLAG_RESPONSE", "FLAG_ERROR", "FLAG_NO_REPLY", "Op", "ErrorCode", "Header",
    "pack_header", "unpack_header", "pack_keys", "unpack_keys", "pack_keys_sizes",
    "unpack_keys_sizes", "pack_json", "unpack_json", "pack_error", "error_from_meta",
    "error_code_for", "recv_exact", "recv_buffers", "drain", "send_buffers", "local_host_id",
    "tune_socket", "SOCKET_BUFFER", "MAX_HELLO_META", "meta_limit", "is_tls", "pack_touch",
    "unpack_touch", "NO_REPLY_OPS", "recv_at_least", "unpack_sizes", "FLAG_UCX", "UCX_OPS",
    "MAX_UCX_META",
]

MAGIC = b"KVSP"
VERSION = 1
HEADER = struct.Struct("<4sBBHQIIQ")
HEADER_SIZE = HEADER.size  # 32
MAX_META = 16 << 20
MAX_BATCH = 1 << 16
MAX_DATA = 1 << 36
MISSING = (1 << 64) - 1
MAX_HELLO_META = 4096  # a HELLO's JSON: token, host id, pid
MAX_UCX_META = 16384  # a UCX op's JSON: a worker address (hex) and a tag prefix

FLAG_RESPONSE = 0x1
FLAG_ERROR = 0x2
FLAG_NO_REPLY = 0x4
FLAG_UCX = 0x8  # the blocks move as UCX messages (kvstore.net.ucx)

_U32 = struct.Struct("<I")
_U16 = struct.Struct("<H")
_IOV_MAX = 512  # stay well under the kernel's IOV_MAX (1024)
SOCKET_BUFFER = 4 << 20


class Op(IntEnum):
    HELLO = 1
    PUT = 2
    GET = 3
    CONTAINS = 4
    PREFIX_LEN = 5
    DELETE = 6
    STATS = 7
    RESERVE = 8
    COMMIT = 9
    ABORT = 10
    PIN = 11
    UNPIN = 12
    TOUCH = 13
    UCX = 14
    GPU_HANDLE = 15
    GPU_PIN = 16
    GPU_UNPIN = 17
    GPU_RESERVE = 18
    GPU_COMMIT = 19
    GPU_ABORT = 20


class ErrorCode(IntEnum):
    PROTOCOL = 1
    AUTH = 2
    STORE_FULL = 3
    CORRUPT = 4
    UNAVAILABLE = 5
    INTERNAL = 6
    UNSUPPORTED = 7


_EXC_BY_CODE: dict[int, type[KVStoreError]] = {
    ErrorCode.PROTOCOL: ProtocolError,
    ErrorCode.AUTH: AuthError,
    ErrorCode.STORE_FULL: StoreFull,
    ErrorCode.CORRUPT: CorruptBlock,
    ErrorCode.UNAVAILABLE: StoreUnavailable,
    ErrorCode.INTERNAL: KVStoreError,
    ErrorCode.UNSUPPORTED: Unsupported,
}


_KEYS_META = 4 + MAX_BATCH * KEY_BYTES
_KEYS_SIZES_META = 4 + MAX_BATCH * (KEY_BYTES + 8)
_TOUCH_META = 4 + MAX_BATCH * (KEY_BYTES + 4 + 8)
_META_LIMIT: dict[int, int] = {Op.HELLO: MAX_HELLO_META, Op.PUT: _KEYS_SIZES_META, Op.RESERVE: _KEYS_SIZES_META,
               Op.STATS: 0, Op.TOUCH: _TOUCH_META, Op.UCX: MAX_UCX_META, Op.GPU_HANDLE: 0,
               Op.GPU_RESERVE: _KEYS_SIZES_META}
NO_REPLY_OPS = frozenset({Op.UNPIN, Op.TOUCH})  # the ops that may be sent with FLAG_NO_REPLY
UCX_OPS = frozenset({Op.GET, Op.RESERVE})  # the ops that may be sent with FLAG_UCX


def meta_limit(op: int) -> int:
    """The largest meta a request of ``op`` can carry (keys ops: ``MAX_BATCH`` keys)."""
    return _META_LIMIT.get(op, _KEYS_META)


class Header(NamedTuple):
    """A parsed frame header (a tuple: one allocation per frame, read by field name)."""

    op: int
    flags: int
    request_id: int
    meta_len: int
    data_len: int


def pack_header(op: int, flags: int, request_id: int, meta_len: int, data_len: int = 0) -> bytes:
    return HEADER.pack(MAGIC, VERSION, op, flags, request_id, meta_len, 0, data_len)


def unpack_header(buf) -> Header:
    """Parse and validate a frame header; raise ``ProtocolError`` on anything malformed."""
    magic, version, op, flags, rid, meta_len, _, data_len = HEADER.unpack(buf)
    if magic != MAGIC:
        raise ProtocolError(f"bad frame magic {bytes(magic)!r}, expected {MAGIC!r}: "
                            "the peer does not speak the kvstore protocol")
    if version != VERSION:
        raise ProtocolError(f"protocol version {version}, this side speaks {VERSION}: "
                            "run the same kvstore version on client and daemon")
    if meta_len > MAX_META:
        raise ProtocolError(f"frame meta of {meta_len} bytes exceeds the {MAX_META}-byte limit")
    if data_len > MAX_DATA:
        raise ProtocolError(f"frame data of {data_len} bytes exceeds the {MAX_DATA}-byte limit")
    return Header(op, flags, rid, meta_len, data_len)


def _check_count(n: int) -> None:
    if n > MAX_BATCH:
        raise ProtocolError(f"batch of {n} keys exceeds the {MAX_BATCH}-key limit; split it")


def pack_keys(keys: Sequence[bytes]) -> bytes:
    _check_count(len(keys))
    return _U32.pack(len(keys)) + b"".join(keys)


def _key_count(meta, per_key: int) -> int:
    if len(meta) < 4:
        raise ProtocolError("meta too short for a key count")
    (n,) = _U32.unpack_from(meta, 0)
    _check_count(n)
    if len(meta) != 4 + n * per_key:
        raise ProtocolError(f"meta of {len(meta)} bytes does not hold {n} keys")
    return n


def unpack_keys(meta) -> list[BlockKey]:
    mv = memoryview(meta)
    n = _key_count(mv, KEY_BYTES)
    return [BlockKey(mv[4 + i * KEY_BYTES: 4 + (i + 1) * KEY_BYTES]) for i in range(n)]


def pack_keys_sizes(keys: Sequence[bytes], sizes: Sequence[int]) -> bytes:
    if len(keys) != len(sizes):
        raise ValueError(f"{len(keys)} keys but {len(sizes)} sizes")
    return pack_keys(keys) + np.asarray(sizes, dtype="<u8").tobytes()


def unpack_keys_sizes(meta) -> tuple[list[BlockKey], list[int]]:
    mv = memoryview(meta)
    n = _key_count(mv, KEY_BYTES + 8)
    keys = [BlockKey(mv[4 + i * KEY_BYTES: 4 + (i + 1) * KEY_BYTES]) for i in range(n)]
    sizes = np.frombuffer(mv, "<u8", n, 4 + n * KEY_BYTES).tolist()
    if any(s == 0 for s in sizes):
        raise ProtocolError("a block of 0 bytes: every block value must be non-empty")
    return keys, sizes


def pack_touch(keys: Sequence[bytes], counts: Sequence[int], sizes: Sequence[int]) -> bytes:
    """A TOUCH meta: keys, then their u32 read counts, then their u64 sizes."""
    return (pack_keys(keys) + np.asarray(counts, dtype="<u4").tobytes()
            + np.asarray(sizes, dtype="<u8").tobytes())


def unpack_touch(meta) -> tuple[list[BlockKey], list[int], list[int]]:
    mv = memoryview(meta)
    n = _key_count(mv, KEY_BYTES + 12)
    keys = [BlockKey(mv[4 + i * KEY_BYTES: 4 + (i + 1) * KEY_BYTES]) for i in range(n)]
    at = 4 + n * KEY_BYTES
    counts = np.frombuffer(mv, "<u4", n, at).tolist()
    sizes = np.frombuffer(mv, "<u8", n, at + 4 * n).tolist()
    return keys, counts, sizes


def unpack_sizes(meta) -> list[int]:
    """A meta of u64 sizes (a GET's answer) as ints."""
    return np.frombuffer(meta, "<u8").tolist()


def pack_json(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def unpack_json(meta) -> Any:
    try:
        return json.loads(bytes(meta))
    except ValueError as e:
        raise ProtocolError(f"malformed JSON meta: {e}") from None


def pack_error(code: ErrorCode, message: str) -> bytes:
    return _U16.pack(int(code)) + message.encode("utf-8", "replace")


def error_from_meta(meta) -> KVStoreError:
    """The exception an ERROR frame's meta stands for."""
    if len(meta) < 2:
        return ProtocolError("malformed error frame from the daemon")
    (code,) = _U16.unpack_from(meta, 0)
    cls = _EXC_BY_CODE.get(code, KVStoreError)
    return cls(bytes(meta[2:]).decode("utf-8", "replace"))


def error_code_for(exc: BaseException) -> ErrorCode:
    for code, cls in _EXC_BY_CODE.items():
        if cls is not KVStoreError and isinstance(exc, cls):
            return ErrorCode(code)
    return ErrorCode.INTERNAL


# --- socket helpers shared by daemon and client --------------------------------------------


def tune_socket(sock: socket.socket, timeout: float | None) -> None:
    """Set a connected socket up for bulk transfers (daemon and client alike):

    - ``TCP_NODELAY``: a request is one small frame; waiting for Nagle would add a delay.
    - ``SO_RCVBUF``/``SO_SNDBUF`` of ``SOCKET_BUFFER`` bytes: fewer wake-ups per megabyte,
      so a batch streams in fewer, larger ``recvmsg_into``/``sendmsg`` calls (Linux caps it
      at ``net.core.rmem_max``/``wmem_max``).
    - Blocking, with ``timeout`` as the kernel's ``SO_RCVTIMEO``/``SO_SNDTIMEO`` rather than
      Python's ``settimeout``, which turns every call into a ``poll`` plus a non-blocking
      call (and a large ``sendmsg`` into many). A timed-out call raises an ``OSError``
      (``BlockingIOError``); ``timeout`` None waits forever.
    """
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_RCVBUF, socket.SO_SNDBUF) if SOCKET_BUFFER else ():
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER)
        except OSError:
            pass
    sock.settimeout(None)
    if timeout is not None:
        sec = int(timeout)
        tv = struct.pack("ll", sec, int((timeout - sec) * 1e6))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


def is_tls(sock: socket.socket) -> bool:
    """Whether ``sock`` is a TLS socket (``kvstore.tls``). TLS sockets have no scatter/gather
    calls (``recvmsg_into``/``sendmsg``): the helpers below move one buffer a call on them,
    and their timeouts are Python's (``settimeout``), not the kernel's: with a kernel timeout
    a blocking TLS read that times out is retried by the ssl module forever."""
    return isinstance(sock, ssl.SSLSocket)


def recv_exact(sock: socket.socket, view: memoryview,
               before: Callable[[], None] | None = None) -> None:
    """Fill ``view`` from ``sock``; raise ``ConnectionError`` on EOF (a truncated frame)."""
    recv_buffers(sock, [view], before)


def _advance(bufs: list[memoryview], i: int, n: int) -> int:
    """Account ``n`` bytes moved starting at ``bufs[i]``: drop the buffers they complete,
    trim the one they end in (in place); return the index of the first unfinished buffer."""
    while n:
        b = bufs[i]
        if n >= b.nbytes:
            n -= b.nbytes
            i += 1
        else:
            bufs[i] = b[n:]
            n = 0
    return i


def recv_buffers(sock: socket.socket, views: list, before: Callable[[], None] | None = None) -> int:
    """Fill every writable view in order with as few syscalls as the kernel allows
    (``recvmsg_into``, up to ``_IOV_MAX`` views a call); return the bytes read. Raise
    ``ConnectionError`` on EOF (a truncated frame). ``before`` is called before every
    receive call (the daemon's whole-frame deadline: it raises once the frame is late)."""
    bufs = [v for v in (memoryview(b).cast("B") for b in views) if v.nbytes]
    total = sum(v.nbytes for v in bufs)
    tls = is_tls(sock)
    i = 0
    while i < len(bufs):
        if before is not None:
            before()
        if tls or i + 1 == len(bufs):  # one left: recv_into is the cheaper call
            got = sock.recv_into(bufs[i])
        else:
            got = sock.recvmsg_into(bufs[i: i + _IOV_MAX])[0]
        if got == 0:
            left = sum(v.nbytes for v in bufs[i:])
            raise ConnectionError(f"peer closed the connection {left} bytes short of a frame")
        i = _advance(bufs, i, got)
    return total


def recv_at_least(sock: socket.socket, views: list, nbytes: int) -> int:
    """Read into the views in order until at least ``nbytes`` have come, in one call when they
    are there (a response's header and meta, and the first bytes of its data, at once); the
    bytes read, possibly more than ``nbytes`` (never past the views). ``ConnectionError`` on EOF."""
    bufs = [v for v in (memoryview(b).cast("B") for b in views) if v.nbytes]
    one = is_tls(sock) or len(bufs) == 1
    total = i = 0
    while total < nbytes:
        got = sock.recv_into(bufs[i]) if one else sock.recvmsg_into(bufs[i: i + _IOV_MAX])[0]
        if got == 0:
            raise ConnectionError(f"peer closed the connection {nbytes - total} bytes short of a frame")
        total += got
        i = _advance(bufs, i, got)
        if one and i:  # the first view is full: the rest one at a time is recv_buffers' job
            break
    return total


def drain(sock: socket.socket, nbytes: int, scratch: memoryview,
          before: Callable[[], None] | None = None) -> None:
    """Read and discard ``nbytes`` (keeps the stream framed after a rejected payload)."""
    while nbytes > 0:
        chunk = min(nbytes, scratch.nbytes)
        recv_exact(sock, scratch[:chunk], before)
        nbytes -= chunk


def send_buffers(sock: socket.socket, buffers: list) -> None:
    """Send every buffer in order with as few syscalls as the kernel allows (``sendmsg``)."""
    bufs = [v for v in (memoryview(b).cast("B") for b in buffers) if v.nbytes]
    if is_tls(sock):
        _send_tls(sock, bufs)
        return
    i = 0
    while i < len(bufs):
        i = _advance(bufs, i, sock.sendmsg(bufs[i: i + _IOV_MAX]))


_TLS_COALESCE = 64 << 10


def _send_tls(sock: socket.socket, bufs: list[memoryview]) -> None:
    """``send_buffers`` on TLS: small buffers joined (a header and its meta go in one
    record), large ones written as they are."""
    pending: list[memoryview] = []
    size = 0
    for b in bufs:
        if b.nbytes >= _TLS_COALESCE:
            if pending:
                sock.sendall(b"".join(pending))
                pending, size = [], 0
            sock.sendall(b)
            continue
        pending.append(b)
        size += b.nbytes
        if size >= _TLS_COALESCE:
            sock.sendall(b"".join(pending))
            pending, size = [], 0
    if pending:
        sock.sendall(b"".join(pending))


def local_host_id() -> str:
    """This machine's identity as the daemon and clients compare it (hex).

    Same boot id and hostname: the same kernel and, in practice, the same ``/dev/shm``. A
    client that matches still verifies that it can map the arena before it uses it.
    """
    import xxhash

    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            boot = f.read().strip()
    except OSError:
        boot = b""
    return xxhash.xxh3_128(boot + b"\0" + socket.gethostname().encode()).hexdigest()
