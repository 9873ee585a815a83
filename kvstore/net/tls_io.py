"""The daemon's non-blocking TLS steps (``kvstore.net.session``; settings in ``kvstore.tls``).

A TLS socket refuses ``MSG_DONTWAIT`` and, blocking with a kernel ``SO_RCVTIMEO``, retries a
timed-out read forever (``sockio.is_tls``); so a session on TLS reads without waiting by
setting a zero Python timeout for the call, and runs its handshake in non-blocking steps.
"""

from __future__ import annotations

import socket
import ssl
from typing import Literal

__all__ = ["Step", "handshake_step", "pending", "recv_nowait", "refuse"]

Step = Literal["done", "read", "write"]  # finished / wants readable / wants writable


def handshake_step(sock: socket.socket, timeout: float) -> Step:
    """Advance the handshake of ``sock`` (a TLS socket, non-blocking until it is done, then
    left with ``timeout``). Raises ``OSError`` (``ssl.SSLError``) when it fails: a refused
    certificate, a peer that does not speak TLS, a reset."""
    assert isinstance(sock, ssl.SSLSocket)
    try:
        sock.do_handshake()
    except ssl.SSLWantReadError:
        return "read"
    except ssl.SSLWantWriteError:
        return "write"
    sock.settimeout(timeout)
    return "done"


def recv_nowait(sock: socket.socket, buf: memoryview, timeout: float) -> int | Step:
    """Bytes read into ``buf`` from a TLS socket without waiting (0: end of stream), or what
    it waits for ("read", "write"); the socket's ``timeout`` is restored."""
    sock.settimeout(0.0)
    try:
        return sock.recv_into(buf, buf.nbytes)
    except (ssl.SSLWantReadError, BlockingIOError, InterruptedError):
        return "read"
    except ssl.SSLWantWriteError:
        return "write"
    finally:
        sock.settimeout(timeout)


def pending(sock: socket.socket) -> int:
    """Decrypted bytes TLS holds that the kernel no longer shows (0 on a plain socket)."""
    return sock.pending() if isinstance(sock, ssl.SSLSocket) else 0


def refuse(sock: socket.socket) -> None:
    """After a failed handshake: let the alert TLS queued reach the peer before the socket
    is closed. Closing with the peer's bytes unread would send a reset, which can discard
    the alert, and the peer would see a bare end of stream instead of why."""
    try:
        sock.shutdown(socket.SHUT_WR)  # the alert, then our FIN
        for _ in range(4):  # what the peer sent so far: read, so that close sends no reset
            if not sock.recv(1 << 16, socket.MSG_DONTWAIT):
                break
    except OSError:
        pass
