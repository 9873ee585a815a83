"""The TCP data path of ``Client`` (``kvstore.client.node``): block bytes in PUT/GET frames.

The frames are ``kvstore.net.protocol``'s (its docstring is the spec). A put sends its values'
bytes after the request, straight from the caller's buffers (a value of several parts, part
after part). A get's answer carries each present block's size, then the blocks in key order,
received straight into the caller's buffers with scatter reads (one ``recvmsg_into`` fills many
blocks); a one-block get's header, size and first bytes come in one ``recv``. A ``Sink``
consumes each block as soon as it lands (or names where it lands: ``kvstore.net.buffers``).
A buffer too small for its block raises ``ValueError`` after the rest of the answer was
drained, so the connection stays in step. Each function runs on one connection under the
client's lock.
"""

from __future__ import annotations

import numpy as np

from kvstore.errors import StoreFull
from kvstore.net import protocol as P
from kvstore.net.buffers import Dest
from kvstore.net.connection import Connection

__all__ = ["put", "get", "read"]


def put(conn: Connection, keys, srcs: list[list[np.ndarray]]) -> None:
    """PUT the values (stored or not as a whole: ``StoreFull`` past the node's ``max_data``)."""
    sizes = [sum(p.nbytes for p in ps) for ps in srcs]
    total = sum(sizes)
    if total > conn.hello["max_data"]:
        raise StoreFull(f"a put of {total} bytes exceeds the node's {conn.hello['max_data']}"
                        "-byte arena; put fewer blocks at once or raise its --memory")
    conn.exchange(P.Op.PUT, P.pack_keys_sizes(keys, sizes), [p for ps in srcs for p in ps],
                  expect=len(keys))


def _get_one(conn: Connection, key: bytes, d: Dest) -> bool:
    """One block: its answer's header, size and first bytes in one ``recv``, straight
    into the buffer (a buffer too small for the block may have been written)."""
    view = d.array.data  # a memoryview of the flat uint8 buffer
    h, meta, got = conn.exchange_into(P.Op.GET, P.pack_keys([key]), expect=8, spill=view)
    s = int.from_bytes(meta, "little")
    if s == P.MISSING:
        return False
    if s > d.array.nbytes:
        conn.drain(h.data_len - got)
        raise ValueError(f"buffer 0 holds {d.array.nbytes} bytes, its block is {s}")
    if got < s:
        conn.recv([view[got:s]])
    if d.staged:
        d.finish(s)
    return True


def get(conn: Connection, keys, dests: list[Dest]) -> list[bool]:
    """GET the blocks into their destinations; which were found."""
    if len(keys) == 1 and dests[0].array.nbytes and dests[0].sink is None:
        return [_get_one(conn, keys[0], dests[0])]
    h, meta = conn.exchange(P.Op.GET, P.pack_keys(keys), keep_data=True, expect=8 * len(keys))
    sizes = np.frombuffer(meta, "<u8").tolist()
    views: list[list[np.ndarray]] = []
    landed: list[bool] = []  # the block lands where its sink asked (``Sink.landing``)
    for i, (d, s) in enumerate(zip(dests, sizes)):
        if s == P.MISSING:
            continue
        land = d.sink.landing(s) if d.sink is not None else None
        if land is None and s > d.array.nbytes:
            conn.drain(h.data_len)
            raise ValueError(f"buffer {i} holds {d.array.nbytes} bytes, its block is {s}")
        views.append(land if land is not None else [d.array[:s]])
        landed.append(land is not None)
    present = [(d, s) for d, s in zip(dests, sizes) if s != P.MISSING]
    if any(d.sink is not None for d, _ in present):
        # A sink consumes each block as soon as it lands, while it is still in cache (or
        # is told its bytes are where it asked); the daemon keeps sending meanwhile.
        for (d, s), view, there in zip(present, views, landed):
            conn.recv(view)
            if there:
                assert d.sink is not None
                d.sink.landed(s)
            else:
                d.finish(s)
    else:
        conn.recv([v for vs in views for v in vs])  # every block, in key order, in few syscalls
        for d, s in present:
            if d.staged:
                d.finish(s)
    return [s != P.MISSING for s in sizes]


def read(conn: Connection, keys) -> list[bytes | None]:
    """GET the blocks as ``bytes`` (None when absent)."""
    _, meta = conn.exchange(P.Op.GET, P.pack_keys(keys), keep_data=True, expect=8 * len(keys))
    bufs = [None if s == P.MISSING else bytearray(s) for s in np.frombuffer(meta, "<u8").tolist()]
    conn.recv([b for b in bufs if b is not None])
    return [None if b is None else bytes(b) for b in bufs]
