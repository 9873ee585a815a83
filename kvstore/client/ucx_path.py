"""The UCX data path of ``Client`` (``kvstore.client.node``): blocks as tagged UCX messages.

The wire is ``kvstore.net.ucx``'s (its docstring is the spec); requests and answers travel on
the connection's socket as always. A put is RESERVE (``FLAG_UCX``) + one UCX send a value,
from the caller's own memory into its reserved slot + COMMIT, which the daemon answers once
the values arrived. A get is GET (``FLAG_UCX``), whose answer gives the sizes, then one UCX
receive a present block, straight into the caller's buffer (a ``Sink``'s landing arrays or
staging array: ``kvstore.net.buffers``). ``timeout`` bounds the wait for each block, as it
bounds each socket wait. A failed or late transfer raises ``UcxError`` (a
``ConnectionError``): ``Client`` drops the connection, whose endpoint's close cancels what is
still posted, and the daemon releases what the connection reserved. The client's
``bytes_sent``/``bytes_received`` stay the socket's: UCX bytes are not counted there. Each
function runs on one connection under the client's lock.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from kvstore.net import protocol as P
from kvstore.net import ucx
from kvstore.net.buffers import Dest
from kvstore.net.connection import Connection

__all__ = ["put", "get", "read"]


def _link(conn: Connection) -> ucx.Link:
    assert conn.ucx is not None, "the UCX path runs on a connection that set it up"
    return conn.ucx


def _whole(parts: list[np.ndarray]) -> np.ndarray:
    """One contiguous buffer of a value (a UCX message is one buffer): a value of several
    parts is joined, one copy."""
    return parts[0] if len(parts) == 1 else np.concatenate([p.reshape(-1).view(np.uint8) for p in parts])


def put(conn: Connection, keys, srcs: list[list[np.ndarray]], timeout: float) -> None:
    """RESERVE, send each value the daemon has no copy of, COMMIT."""
    link = _link(conn)
    sizes = [sum(p.nbytes for p in ps) for ps in srcs]
    _, meta = conn.exchange(P.Op.RESERVE, P.pack_keys_sizes(keys, sizes), expect=8 * len(keys),
                            flags=P.FLAG_UCX)
    rid = conn.rid
    mine = [i for i, off in enumerate(np.frombuffer(meta, "<u8").tolist()) if off != P.MISSING]
    if not mine:
        return
    sends = link.ep.send([_whole(srcs[i]) for i in mine], [ucx.tag(link.peer_prefix, rid, i) for i in mine])
    ucx.wait(sends, time.monotonic() + timeout, idle=timeout)
    conn.exchange(P.Op.COMMIT, P.pack_keys([keys[i] for i in mine]), expect=0)


def _sizes(conn: Connection, keys) -> tuple[int, list[int]]:
    _, meta = conn.exchange(P.Op.GET, P.pack_keys(keys), expect=8 * len(keys), flags=P.FLAG_UCX)
    return conn.rid, np.frombuffer(meta, "<u8").tolist()


def _receive(conn: Connection, rid: int, at: list[int], views: list[Any], timeout: float) -> None:
    link = _link(conn)
    ucx.wait(link.ep.recv(views, [ucx.tag(link.prefix, rid, i) for i in at]),
             time.monotonic() + timeout, idle=timeout)


def get(conn: Connection, keys, dests: list[Dest], timeout: float) -> list[bool]:
    """GET the blocks into their destinations; which were found."""
    rid, sizes = _sizes(conn, keys)
    at = [i for i, s in enumerate(sizes) if s != P.MISSING]
    views: list[np.ndarray] = []
    landings: dict[int, list[np.ndarray]] = {}
    small: tuple[int, int, int] | None = None
    for i in at:
        d, s = dests[i], sizes[i]
        land = d.sink.landing(s) if d.sink is not None else None
        if land is not None and len(land) == 1:
            landings[i] = land
            views.append(land[0])
        elif land is not None:  # several arrays: one message lands whole, then is split
            landings[i] = land
            views.append(np.empty(s, np.uint8))
        elif s > d.array.nbytes:  # still received (the daemon sends it), then refused
            small = small or (i, d.array.nbytes, s)
            views.append(np.empty(s, np.uint8))
        else:
            views.append(d.array[:s])
    _receive(conn, rid, at, views, timeout)
    if small is not None:
        raise ValueError(f"buffer {small[0]} holds {small[1]} bytes, its block is {small[2]}")
    for i, view in zip(at, views):
        d, s = dests[i], sizes[i]
        land = landings.get(i)
        if land is not None:
            assert d.sink is not None
            if len(land) > 1:
                pos = 0
                for part in land:
                    part[:] = view[pos: pos + part.nbytes]
                    pos += part.nbytes
            d.sink.landed(s)
        elif d.staged:
            d.finish(s)
    return [s != P.MISSING for s in sizes]


def read(conn: Connection, keys, timeout: float) -> list[bytes | None]:
    """GET the blocks as ``bytes`` (None when absent)."""
    rid, sizes = _sizes(conn, keys)
    at = [i for i, s in enumerate(sizes) if s != P.MISSING]
    bufs = [bytearray(sizes[i]) for i in at]
    _receive(conn, rid, at, bufs, timeout)
    out: list[bytes | None] = [None] * len(keys)
    for i, b in zip(at, bufs):
        out[i] = bytes(b)
    return out

