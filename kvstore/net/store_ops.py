"""The daemon's store ops, PUT to TOUCH (``kvstore.net.protocol``'s table): what each request
does to the ``BlockStore`` and what it answers.

Served by a ``Session`` (``kvstore.net.session``, which imports this module and dispatches to
``HANDLERS`` once HELLO succeeded and the header passed its checks), like the CUDA IPC ops of
``kvstore.net.gpu_ops``; the connection's own ops, HELLO and UCX, are the session's.

- PUT reads its values straight into the arena slots it reserved (``owner=session``) and
  commits them; a block the store had no room for is drained from the socket and answered 0.
  GET pins its blocks for the send only and ``sendmsg``'s them from their slots (or, with
  ``FLAG_UCX``, sends them as UCX messages on the session's channel).
- RESERVE, COMMIT, ABORT: the same-host put (the client writes the arena itself) or, with
  ``FLAG_UCX``, values that arrive as UCX messages; the session keeps what it reserved
  (``reserved``) until COMMIT or ABORT. PIN and UNPIN: the same-host get; the session counts
  its pins (``pins``). COMMIT, ABORT or UNPIN of keys the connection does not hold is bad
  input: a PROTOCOL error, and the connection closes.
- What one connection holds reserved (a PUT in flight, RESERVEs not yet committed) is
  capped at the server's ``max_reserve`` bytes (``_check_reserve``), so no single client
  evicts more than its share of the arena before it has sent the bytes. A PUT over the cap
  ends the connection (its data is too much to drain); a RESERVE over it is refused (FULL).
- CONTAINS, PREFIX_LEN, DELETE, STATS answer from the store; TOUCH (the client's report of
  the reads its shared index served) makes those blocks the most recently used and counts
  the reads as host hits.

Whatever a session reserved or pinned here is released by ``Session.release()``.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Callable, NoReturn, Protocol

import numpy as np

from kvstore.errors import KVStoreError, ProtocolError, StoreFull
from kvstore.keys import BlockKey
from kvstore.net import protocol as P
from kvstore.net.frames import Close, FrameReader
from kvstore.net.session_host import DataPath, Direction, SessionHost
from kvstore.node.store import BlockStore

if TYPE_CHECKING:
    from kvstore.net.ucx_channel import UcxChannel

__all__ = ["HANDLERS", "Session"]

log = logging.getLogger("kvstore.net.server")


class Session(Protocol):
    """What these ops need of ``kvstore.net.session.Session`` (which imports this module)."""

    server: SessionHost
    store: BlockStore
    reader: FrameReader
    peer: object
    reserved: dict[BlockKey, int]   # RESERVEd, not yet committed or aborted: key -> bytes
    reserved_bytes: int
    pins: collections.Counter[BlockKey]
    ucx: UcxChannel | None

    def reply(self, h: P.Header, meta: bytes = b"", data: list | None = None) -> None: ...

    def fail(self, op: int, rid: int, exc: KVStoreError) -> NoReturn: ...

    def count_bytes(self, direction: Direction, path: DataPath, nbytes: int) -> None: ...

    def close_ucx(self) -> bool: ...


def _check_reserve(s: Session, total: int, op: str) -> None:
    """Refuse (``StoreFull``) a reservation of ``total`` bytes that would take the connection
    over its cap (module docstring)."""
    cap = s.server.max_reserve
    if s.reserved_bytes + total > cap:
        raise StoreFull(
            f"a {op} of {total} bytes would hold {s.reserved_bytes + total} bytes "
            f"reserved on this connection, over its {cap}-byte cap (max_data); put fewer "
            "blocks at once, commit reservations first, or raise the daemon's --max-conn-reserve")


def _owned_reservations(s: Session, keys: list[BlockKey], verb: str) -> int:
    """Take ``keys`` out of what the session reserved; their bytes. All must be its own."""
    missing = [k for k in keys if k not in s.reserved]
    if missing:
        raise ProtocolError(f"{verb} of {len(missing)} key(s) this connection has not "
                            f"reserved (first {missing[0].hex()})")
    nbytes = sum(s.reserved.pop(k) for k in keys)
    s.reserved_bytes -= nbytes
    return nbytes


def _put(s: Session, h: P.Header, meta: memoryview) -> None:
    keys, sizes = P.unpack_keys_sizes(meta)
    total = sum(sizes)
    if total != h.data_len:
        raise ProtocolError(f"PUT declares blocks of {total} bytes in all but carries "
                            f"{h.data_len} bytes of data")
    try:
        _check_reserve(s, total, "PUT")
    except StoreFull as e:
        s.fail(h.op, h.request_id, e)  # too much to drain: end the connection
    try:
        res = s.store.reserve(list(zip(keys, sizes)), owner=s)
    except StoreFull:
        s.reader.drain(total)
        raise
    # The reservations are the session's (owner=s): if the frame breaks off or runs past its
    # deadline, release() aborts them. ``s.reserved`` tracks only RESERVE's, which the client
    # commits or aborts in later frames.
    buf = s.store.arena.buf
    for r, size in zip(res, sizes):
        if r is None:
            s.reader.drain(size)
        else:
            s.reader.read_into(buf[r.offset: r.offset + size])
    s.store.commit([k for k, r in zip(keys, res) if r is not None])
    s.count_bytes("in", "tcp", total)
    s.reply(h, bytes(1 if r is not None else 0 for r in res))


def _get(s: Session, h: P.Header, meta: memoryview) -> None:
    keys = P.unpack_keys(meta)
    # Pinned for the send only, and unpinned below however it ends: no owner to track.
    locs = s.store.pin(keys)
    pinned = [k for k, loc in zip(keys, locs) if loc is not None]
    try:
        buf = s.store.arena.buf
        if len(locs) == 1:
            loc = locs[0]
            sizes = (P.MISSING if loc is None else loc.size).to_bytes(8, "little")
        else:
            sizes = np.fromiter((loc.size if loc is not None else P.MISSING for loc in locs),
                                dtype="<u8", count=len(locs)).tobytes()
        data = [buf[loc.offset: loc.offset + loc.size] for loc in locs if loc is not None]
        if s.ucx is not None and h.flags & P.FLAG_UCX:
            s.reply(h, sizes)
            try:
                s.ucx.send_blocks(h.request_id, data, [i for i, loc in enumerate(locs) if loc is not None],
                                  time.monotonic() + s.server.limits.frame_timeout)
            except ConnectionError as e:  # unpinned below once the channel is closed
                log.info("closing connection %s: %s", s.peer, e)
                if not s.close_ucx():
                    pinned = []
                raise Close() from None
            s.count_bytes("out", "ucx", sum(v.nbytes for v in data))
        else:
            s.reply(h, sizes, data)
            s.count_bytes("out", "tcp", sum(v.nbytes for v in data))
    finally:
        if pinned:
            s.store.unpin(pinned)


def _contains(s: Session, h: P.Header, meta: memoryview) -> None:
    s.reply(h, bytes(s.store.contains(P.unpack_keys(meta))))


def _prefix_len(s: Session, h: P.Header, meta: memoryview) -> None:
    s.reply(h, P._U32.pack(s.store.prefix_len(P.unpack_keys(meta))))


def _delete(s: Session, h: P.Header, meta: memoryview) -> None:
    s.reply(h, P._U32.pack(s.store.delete(P.unpack_keys(meta))))


def _stats(s: Session, h: P.Header, meta: memoryview) -> None:
    stats = dataclasses.asdict(s.store.stats())
    s.reply(h, P.pack_json({"store": stats, "server": s.server.server_stats()}))


def _reserve(s: Session, h: P.Header, meta: memoryview) -> None:
    keys, sizes = P.unpack_keys_sizes(meta)
    _check_reserve(s, sum(sizes), "RESERVE")
    res = s.store.reserve(list(zip(keys, sizes)), owner=s)
    for k, r, size in zip(keys, res, sizes):
        if r is not None:
            s.reserved[k] = size
            s.reserved_bytes += size
    if s.ucx is not None and h.flags & P.FLAG_UCX:  # the values come as UCX messages
        buf = s.store.arena.buf
        mine = [(i, r.offset, size) for i, (r, size) in enumerate(zip(res, sizes)) if r is not None]
        s.ucx.post(h.request_id, [keys[i] for i, _, _ in mine],
                   [buf[off: off + size] for _, off, size in mine], [i for i, _, _ in mine])
    offsets = np.fromiter((r.offset if r is not None else P.MISSING for r in res),
                          dtype="<u8", count=len(res))
    s.reply(h, offsets.tobytes())


def _commit(s: Session, h: P.Header, meta: memoryview) -> None:
    keys = P.unpack_keys(meta)
    path: DataPath = "shm"
    if s.ucx is not None and s.ucx.posted(keys):
        path = "ucx"
        try:
            s.ucx.take(keys, s.server.limits.frame_timeout)
        except ConnectionError as e:
            s.fail(h.op, h.request_id, ProtocolError(f"COMMIT of values that did not arrive: {e}"))
    nbytes = _owned_reservations(s, keys, "COMMIT")
    s.store.commit(keys)
    s.count_bytes("in", path, nbytes)
    s.reply(h)


def _abort(s: Session, h: P.Header, meta: memoryview) -> None:
    keys = P.unpack_keys(meta)
    if s.ucx is not None and s.ucx.posted(keys):
        raise ProtocolError("ABORT of keys whose values are expected over UCX: close the "
                            "connection instead (kvstore.net.ucx)")
    _owned_reservations(s, keys, "ABORT")
    s.store.abort(keys)
    s.reply(h)


def _pin(s: Session, h: P.Header, meta: memoryview) -> None:
    keys = P.unpack_keys(meta)
    locs = s.store.pin(keys, owner=s)
    n = len(keys)
    out = np.full(2 * n, P.MISSING, dtype="<u8")
    nbytes = 0
    for i, (k, loc) in enumerate(zip(keys, locs)):
        if loc is not None:
            s.pins[k] += 1
            out[i], out[n + i] = loc.offset, loc.size
            nbytes += loc.size
    s.count_bytes("out", "shm", nbytes)
    s.reply(h, out.tobytes())


def _unpin(s: Session, h: P.Header, meta: memoryview) -> None:
    keys = P.unpack_keys(meta)
    need = collections.Counter(keys)
    bad = [k for k, c in need.items() if s.pins[k] < c]
    if bad:
        raise ProtocolError(f"UNPIN of {len(bad)} key(s) this connection has not pinned "
                            f"(first {bad[0].hex()})")
    s.pins.subtract(need)
    s.pins = +s.pins
    s.store.unpin(keys, owner=s)
    if not h.flags & P.FLAG_NO_REPLY:
        s.reply(h)


def _touch(s: Session, h: P.Header, meta: memoryview) -> None:
    keys, counts, sizes = P.unpack_touch(meta)
    s.count_bytes("out", "shm", s.store.touch(keys, counts, sizes))
    if not h.flags & P.FLAG_NO_REPLY:
        s.reply(h)


HANDLERS: dict[int, Callable[[Session, P.Header, memoryview], None]] = {
    P.Op.PUT: _put, P.Op.GET: _get, P.Op.CONTAINS: _contains, P.Op.PREFIX_LEN: _prefix_len,
    P.Op.DELETE: _delete, P.Op.STATS: _stats, P.Op.RESERVE: _reserve, P.Op.COMMIT: _commit,
    P.Op.ABORT: _abort, P.Op.PIN: _pin, P.Op.UNPIN: _unpin, P.Op.TOUCH: _touch,
}
