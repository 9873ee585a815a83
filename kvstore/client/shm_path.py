"""The same-host data path of ``Client`` (``kvstore.client.node``): the daemon's arena mapped.

Puts are RESERVE + a copy into the arena + COMMIT. Gets ask the daemon's shared-memory index
first (``kvstore.node.shared_index``, mapped beside the arena when HELLO names one): a committed
host block is copied out under its slot's seqlock with no message, and the read is reported
later as a batched TOUCH (``kvstore.net.connection``). What the index does not settle (absent,
SSD- or GPU-resident, a slot that kept changing), and every get with a ``Sink`` among its
buffers, takes the PIN path: PIN + copy out of (or a sink's consume where it lies in) the
mapped arena + a one-way UNPIN. Each function runs on one connection under the client's lock.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import numpy as np

from kvstore.net import protocol as P
from kvstore.net.buffers import Dest, Sink
from kvstore.net.connection import Connection
from kvstore.node.shared_index import BADBUF, HIT, SMALL

__all__ = ["PLAIN", "pinned", "put", "get", "get_pinned", "read_plain", "pin_rest", "read",
           "read_pinned"]

PLAIN = (np.ndarray, bytearray, memoryview)  # buffers the index reads into as they are


@contextmanager
def pinned(conn: Connection, keys) -> Iterator[tuple[list[int], list[int]]]:
    """PIN ``keys`` for the block: (offsets, sizes) in the arena, ``P.MISSING`` for absent
    keys; the pinned ones are unpinned (one-way) on the way out, however it is left."""
    n = len(keys)
    _, meta = conn.exchange(P.Op.PIN, P.pack_keys(keys), expect=16 * n)
    arr = np.frombuffer(meta, "<u8")
    offsets, sizes = arr[:n].tolist(), arr[n:].tolist()
    try:
        yield offsets, sizes
    finally:
        held = [k for k, s in zip(keys, sizes) if s != P.MISSING]
        if held:
            conn.send_oneway(P.Op.UNPIN, P.pack_keys(held))


def put(conn: Connection, keys, srcs: list[list[np.ndarray]]) -> None:
    """RESERVE, copy each value's parts into the arena, COMMIT (ABORT if a copy fails)."""
    sizes = [sum(p.nbytes for p in ps) for ps in srcs]
    _, meta = conn.exchange(P.Op.RESERVE, P.pack_keys_sizes(keys, sizes), expect=8 * len(keys))
    offsets = np.frombuffer(meta, "<u8").tolist()
    mine = [k for k, off in zip(keys, offsets) if off != P.MISSING]
    arena = conn.arena_np
    assert arena is not None, "the shared-memory path runs on a mapped connection only"
    try:
        for parts, off in zip(srcs, offsets):
            if off != P.MISSING:
                for src in parts:
                    np.copyto(arena[off: off + src.nbytes], src)
                    off += src.nbytes
    except BaseException:
        if mine:
            conn.exchange(P.Op.ABORT, P.pack_keys(mine), expect=0)
        raise
    if mine:
        conn.exchange(P.Op.COMMIT, P.pack_keys(mine), expect=0)


def read_plain(conn: Connection, keys, buffers) -> tuple[list[bool], list[int]] | None:
    """A get of plain buffers (NumPy arrays, bytearrays, memoryviews) through the index with
    no adapter per buffer (``IndexReader.read_obj``): (found, indices left for the PIN path,
    in key order); None: take the general path (``get``)."""
    if not all(type(b) in PLAIN for b in buffers):
        return None
    index = conn.index_ready()
    if index is None or not index.reads_objects:
        return None
    n = len(keys)
    found = [False] * n
    rest: list[int] = []
    read = index.read_obj
    for i in range(n - 1, -1, -1):  # tail first: the head is reported the most recent
        v = read(keys[i], buffers[i])
        if v >= 0:
            found[i] = True
            conn.note_read(keys[i], v)
        elif v <= -16:
            raise ValueError(f"buffer {i} holds {memoryview(buffers[i]).nbytes} bytes, "
                             f"its block is {-16 - v}")
        elif v == -1 - BADBUF:
            Dest(buffers[i])  # raises what is wrong with it
            return None
        else:
            rest.append(i)
    rest.reverse()
    return found, rest


def pin_rest(conn: Connection, keys, buffers, rest: list[int], found: list[bool]) -> None:
    """``read_plain``'s leftovers through the PIN path (the reads before go first, as TOUCH)."""
    got = get_pinned(conn, [keys[i] for i in rest], [Dest(buffers[i]) for i in rest])
    for i, ok in zip(rest, got):
        found[i] = ok


def get(conn: Connection, keys, dests: list[Dest]) -> list[bool]:
    """The index first (plain buffers, CUDA staging), the PIN path for the rest and for
    every get with a ``Sink`` among its buffers."""
    index = conn.index_ready()
    if index is None or any(d.sink is not None for d in dests):
        return get_pinned(conn, keys, dests)
    n = len(keys)
    found = [False] * n
    rest: list[int] = []
    for i in range(n - 1, -1, -1):  # tail first: the head is reported the most recent
        d = dests[i]
        rc, size = index.get_into(keys[i], d.array)
        if rc == HIT:
            found[i] = True
            conn.note_read(keys[i], size)
            if d.staged:
                d.finish(size)
        elif rc == SMALL:
            raise ValueError(f"buffer {i} holds {d.array.nbytes} bytes, its block is {size}")
        else:
            rest.append(i)
    if rest:  # the PIN path; the reads above are reported (TOUCH) before it, in one send
        rest.reverse()
        got = get_pinned(conn, [keys[i] for i in rest], [dests[i] for i in rest])
        for i, ok in zip(rest, got):
            found[i] = ok
    elif conn.touch_due():
        conn.flush_touches()
    return found


def get_pinned(conn: Connection, keys, dests: list[Dest]) -> list[bool]:
    """PIN, copy out of the arena (a sink consumes its block where it lies), UNPIN."""
    arena = conn.arena_np
    assert arena is not None, "the shared-memory path runs on a mapped connection only"
    with pinned(conn, keys) as (offsets, sizes):
        sunk: list[tuple[Sink, np.ndarray]] = []
        for i, (d, off, s) in enumerate(zip(dests, offsets, sizes)):
            if s == P.MISSING:
                continue
            if s > d.array.nbytes:
                raise ValueError(f"buffer {i} holds {d.array.nbytes} bytes, its block is {s}")
            if d.sink is not None:  # consumed where it lies, pinned: no copy before it
                sunk.append((d.sink, arena[off: off + s]))
                continue
            np.copyto(d.array[:s], arena[off: off + s])
            if d.staged:
                d.finish(s)
        if sunk:  # all at once (a sink may spread them over threads), before the unpin
            type(sunk[0][0]).consume_all(sunk)
    return [s != P.MISSING for s in sizes]


def read(conn: Connection, keys) -> list[bytes | None]:
    """``get_bytes`` on shared memory: the index first (a size probe, then the copy), the
    PIN path for the rest."""
    index = conn.index_ready()
    if index is None:
        return read_pinned(conn, keys)
    out: list[bytes | None] = [None] * len(keys)
    rest: list[int] = []
    probe = np.empty(0, np.uint8)
    for i in range(len(keys) - 1, -1, -1):
        rc, size = index.get_into(keys[i], probe)
        if rc == SMALL:
            buf = bytearray(size)
            rc, size = index.get_into(keys[i], np.frombuffer(buf, np.uint8))
            if rc == HIT:
                out[i] = bytes(buf)
                conn.note_read(keys[i], size)
                continue
        rest.append(i)
    if rest:
        rest.reverse()
        for i, b in zip(rest, read_pinned(conn, [keys[i] for i in rest])):
            out[i] = b
    elif conn.touch_due():
        conn.flush_touches()
    return out


def read_pinned(conn: Connection, keys) -> list[bytes | None]:
    arena = conn.arena
    assert arena is not None, "the shared-memory path runs on a mapped connection only"
    with pinned(conn, keys) as (offsets, sizes):
        return [None if s == P.MISSING else arena.buf[off: off + s].tobytes()
                for off, s in zip(offsets, sizes)]
