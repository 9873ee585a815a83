"""Socket I/O shared by the daemon and the client: set-up for bulk transfers, scatter
receives straight into many buffers, gathered sends, draining, and TLS sockets (which have
no scatter/gather calls: one buffer a call, coalesced on send).

What travels is ``kvstore.net.protocol``'s frames; this module only moves bytes.
"""

from __future__ import annotations

import socket
import ssl
import struct
from typing import Callable

__all__ = ["SOCKET_BUFFER", "tune_socket", "is_tls", "recv_exact", "recv_buffers",
           "recv_at_least", "drain", "send_buffers"]

_IOV_MAX = 512  # stay well under the kernel's IOV_MAX (1024)
SOCKET_BUFFER = 4 << 20


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
