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
STORE_FULL; clients split puts to fit it. Bad input — wrong magic or version, an unknown op, an
absurd length, a malformed meta, sizes that do not add up to the data length, a truncated frame
(EOF or an I/O timeout mid-frame, or a frame not complete within the daemon's frame deadline) —
gets a PROTOCOL error frame where the stream is still readable, and the daemon then closes that
one connection, releasing its reservations and pins. Every other connection is unaffected.
"""

from __future__ import annotations

import json
import struct
from enum import IntEnum
from typing import Any, NamedTuple, Sequence

import numpy as np

from kvstore.errors import (
    AuthError,
    CorruptBlock,
    KVStoreError,
    ProtocolError,
    StoreFull,
    StoreUnavailable,
    Unsupported,
)
from kvstore.keys import KEY_BYTES, BlockKey

__all__ = [
    "MAGIC", "VERSION", "HEADER", "HEADER_SIZE", "MAX_META", "MAX_BATCH", "MAX_DATA", "MISSING",
    "FLAG_RESPONSE", "FLAG_ERROR", "FLAG_NO_REPLY", "Op", "ErrorCode", "Header",
    "pack_header", "unpack_header", "pack_keys", "unpack_keys", "pack_keys_sizes",
    "unpack_keys_sizes", "pack_json", "unpack_json", "pack_error", "error_from_meta",
    "error_code_for",
    "MAX_HELLO_META", "meta_limit", "pack_touch",
    "unpack_touch", "NO_REPLY_OPS", "unpack_sizes", "FLAG_UCX", "UCX_OPS",
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
