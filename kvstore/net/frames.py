"""``FrameReader``: how the daemon reads one connection's frames (``kvstore.net.session`` serves them).

Two modes, one deadline:

- Exact (before HELLO succeeds, and on TLS): a header is read without blocking into the
  reader's own 32 bytes, a HELLO meta into a buffer of exactly its size; nothing is held
  beyond one frame's header and HELLO meta, and nothing blocks, so a peer that has not
  authenticated holds no thread and makes the daemon allocate nothing more.
- Buffered (an authenticated plain-TCP connection): while a serving thread serves the session
  (``attach`` .. ``detach``) the socket is read without blocking into that thread's receive
  buffer (``RX_BUFFER`` bytes, one per serving thread, not per connection), so a request's
  header and meta, and often the next requests (a one-way TOUCH before a GET), come in one
  ``recv``. A read that did not fill the buffer found the socket empty, so once the frames
  in the buffer are served the session goes back to wait without another ``recv``. Meta and
  PUT data beyond what is buffered are read blocking, straight into their destination (a
  PUT's values into their arena slots). Bytes left in the buffer when the step ends (a part
  of the next header, or frames past the step's burst) are kept with the session.

The frame deadline: a frame must be complete within ``frame_timeout`` of its first byte
(``begin``, then every blocking receive checks it; the kernel's ``SO_RCVTIMEO`` is lowered
only near the deadline, so a frame in time costs no extra system call).
"""

from __future__ import annotations

import socket
import struct
import threading
import time

from kvstore.net import protocol as P
from kvstore.net import sockio, tls_io

__all__ = ["FrameReader", "Close", "FrameTimeout", "RX_BUFFER"]

RX_BUFFER = 64 << 10
_SCRATCH = 1 << 20
_local = threading.local()


class Close(Exception):
    """End this session (after an error frame was sent, or the stream is unusable)."""


class FrameTimeout(TimeoutError):
    """A frame was not complete within the frame deadline."""


def _timeval(seconds: float) -> bytes:
    """A ``struct timeval`` of at least 1 ms (0 would mean no timeout at all)."""
    usec = max(1000, int(seconds * 1e6))
    return struct.pack("ll", usec // 1_000_000, usec % 1_000_000)


def _thread_buffer() -> memoryview:
    buf = getattr(_local, "rx", None)
    if buf is None:
        buf = _local.rx = memoryview(bytearray(RX_BUFFER))
    return buf


class FrameReader:
    """One connection's reading state (module docstring). ``want_write``: a TLS step waits
    for writability. ``frame_started``: when the first byte of a frame not yet served came."""

    __slots__ = ("sock", "tls", "frame_timeout", "frame_started", "want_write", "_hdr",
                 "_hdr_got", "_pre", "_pre_got", "_scratch", "_deadline", "_rcvtimeo", "_buf",
                 "_pos", "_end", "_drained", "_carry")

    def __init__(self, sock: socket.socket, frame_timeout: float) -> None:
        self.sock = sock
        self.tls = sockio.is_tls(sock)
        self.frame_timeout = frame_timeout
        self.frame_started: float | None = None
        self.want_write = False
        self._hdr = bytearray(P.HEADER_SIZE)
        self._hdr_got = 0
        self._pre: bytearray | None = None  # the HELLO meta, read without blocking
        self._pre_got = 0
        self._scratch: memoryview | None = None
        self._deadline = 0.0
        self._rcvtimeo = frame_timeout  # the kernel's SO_RCVTIMEO now
        self._buf: memoryview | None = None  # the serving thread's buffer, while attached
        self._pos = self._end = 0
        self._drained = False
        self._carry = b""  # bytes read but not served when the last step ended

    # --- a step ---------------------------------------------------------------------------

    def attach(self, buffered: bool) -> None:
        """Start a step; ``buffered``: read through the serving thread's buffer."""
        self._drained = False
        if buffered and not self.tls and self._buf is None:
            self._buf = _thread_buffer()
            n = len(self._carry)
            self._buf[:n] = self._carry
            self._pos, self._end, self._carry = 0, n, b""

    def detach(self) -> None:
        """End a step: what is still buffered stays with the session."""
        if self._buf is not None:
            self._carry = bytes(self._buf[self._pos: self._end])
            self._buf = None
            self._pos = self._end = 0
            if self._carry and self.frame_started is None:
                self.frame_started = time.monotonic()

    def header(self) -> P.Header | None:
        """The next frame's header, read without blocking; None until it is all there.
        Raises ``Close`` at a clean end of stream, ``ConnectionError`` mid-frame and
        ``ProtocolError`` for a malformed header."""
        buf = self._buf
        if buf is None:
            view = memoryview(self._hdr)
            while self._hdr_got < P.HEADER_SIZE:
                got = self._recv_nowait(view[self._hdr_got:])
                if not got:
                    return None
                self._hdr_got += got
            self._hdr_got = 0
            return P.unpack_header(self._hdr)
        while self._end - self._pos < P.HEADER_SIZE:
            if self._drained or not self._fill():
                return None
        at = self._pos
        self._pos += P.HEADER_SIZE
        return P.unpack_header(buf[at: at + P.HEADER_SIZE])

    def hello_meta(self, h: P.Header) -> memoryview | None:
        """A HELLO's meta, read without blocking (exact mode); None until it is all there."""
        if self._pre is None:
            self._pre, self._pre_got = bytearray(h.meta_len), 0
        view = memoryview(self._pre)
        while self._pre_got < h.meta_len:
            got = self._recv_nowait(view[self._pre_got:])
            if not got:
                return None
            self._pre_got += got
        self._pre = None
        return view

    def begin(self) -> None:
        """An authenticated frame's header is in: its deadline runs from its first byte."""
        self.reset_timeouts()
        self._deadline = (self.frame_started or time.monotonic()) + self.frame_timeout

    def end_frame(self) -> None:
        """The frame is served; a next one may already have begun (buffered bytes)."""
        self.frame_started = time.monotonic() if self._end > self._pos else None

    def meta(self, h: P.Header) -> memoryview:
        """The frame's meta (valid until the next read), blocking under the deadline."""
        n, buf = h.meta_len, self._buf
        if buf is not None and self._end - self._pos >= n:
            at = self._pos
            self._pos += n
            return buf[at: at + n]
        meta = memoryview(bytearray(n))
        self.read_into(meta)
        return meta

    def read_into(self, view: memoryview) -> None:
        """Fill ``view``: buffered bytes first, then blocking receives under the deadline."""
        took = self._take(view)
        if took < view.nbytes:
            self._drained = False
            sockio.recv_exact(self.sock, view[took:], self._before_recv)

    def drain(self, nbytes: int) -> None:
        """Read and discard ``nbytes`` (keeps the stream framed after a refused payload)."""
        if self._scratch is None:
            self._scratch = memoryview(bytearray(_SCRATCH))
        nbytes -= self._take(self._scratch[: min(nbytes, _SCRATCH)])
        if nbytes > 0:
            self._drained = False
            sockio.drain(self.sock, nbytes, self._scratch, self._before_recv)

    # --- internals --------------------------------------------------------------------------

    def _take(self, view: memoryview) -> int:
        """Copy buffered bytes into the head of ``view``; how many."""
        if self._buf is None:
            return 0
        n = min(view.nbytes, self._end - self._pos)
        if n:
            view[:n] = self._buf[self._pos: self._pos + n]
            self._pos += n
        return n

    def _fill(self) -> bool:
        """Read what the socket holds into the buffer (without blocking); False if nothing."""
        buf = self._buf
        assert buf is not None
        left = self._end - self._pos
        if self._pos:
            buf[:left] = buf[self._pos: self._end]
            self._pos, self._end = 0, left
        got = self._recv_nowait(buf[self._end:])
        self._end += got
        self._drained = got < buf.nbytes - left  # a short read: the socket is empty now
        return got > 0

    def _recv_nowait(self, buf: memoryview) -> int:
        """Bytes read into ``buf`` without blocking (0: nothing there yet)."""
        try:
            if self.tls:  # TLS sockets take no MSG_DONTWAIT (kvstore.net.tls_io)
                got = tls_io.recv_nowait(self.sock, buf, self._rcvtimeo)
                if isinstance(got, str):
                    self.want_write = got == "write"
                    return 0
            else:
                got = self.sock.recv_into(buf, buf.nbytes, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            self._drained = True
            return 0
        if got == 0:
            if self.frame_started is not None or self._end > self._pos or self._hdr_got:
                raise ConnectionError("peer closed the connection mid-frame")
            raise Close()  # a clean end of stream
        if self.frame_started is None:
            self.frame_started = time.monotonic()
        return got

    def _before_recv(self) -> None:
        """The whole-frame deadline, checked before every blocking receive of a frame."""
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise FrameTimeout(f"frame not complete within {self.frame_timeout:g} s")
        slack = max(0.05, 0.1 * self.frame_timeout)
        if left < self._rcvtimeo - slack:
            self._set_rcvtimeo(left)

    def _set_rcvtimeo(self, seconds: float) -> None:
        if self.tls:
            self.sock.settimeout(max(0.001, seconds))
        else:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(seconds))
        self._rcvtimeo = seconds

    def reset_timeouts(self) -> None:
        """Restore the kernel's receive timeout after a frame that lowered it."""
        if self._rcvtimeo != self.frame_timeout:
            self._set_rcvtimeo(self.frame_timeout)

    def handshake_step(self) -> str:
        """One non-blocking step of the TLS handshake (``tls_io.handshake_step``)."""
        step = tls_io.handshake_step(self.sock, self._rcvtimeo)
        self.want_write = step == "write"
        return step
