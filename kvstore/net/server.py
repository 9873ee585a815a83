"""The daemon's socket server: one epoll thread for every waiting connection, a bounded pool
of serving threads for the ones with something to say, over a ``BlockStore``.

Threads (see docs/decisions/0006-daemon-threads-not-asyncio.md and
0007-daemon-epoll-bounded-pool.md):

- ``serve_forever()`` (the caller's thread) owns the listening socket and one epoll set.
  Every connection that waits for its next request waits there, registered one-shot, and
  costs no thread: 10,000 idle clients are 10,000 sockets and small objects, not 10,000
  threads.
- When a connection becomes readable it is handed to a pool of at most
  ``limits.threads`` serving threads (started as needed). The thread runs
  ``Session.step()``: frames are read and answered with blocking ``recv_into``/``sendmsg``
  straight into and out of the arena (the GIL released during each copy; the wire format is
  ``kvstore.net.protocol``), then the connection is re-armed in the epoll set. Unless another
  connection waits for a thread or the pool is spent, the thread first waits up to
  ``LINGER_MS`` for the connection's next request (``poll`` on its socket): a client that
  asks again at once is served by the same thread, with no epoll round and no hand-over
  between threads (one wake-up per request instead of two; on TLS it never lingers).
- The epoll thread also enforces the limits of ``ServerLimits``: at most
  ``max_connections`` (one more gets an UNAVAILABLE error frame and is closed), HELLO within
  ``hello_timeout``, an idle connection dropped after ``idle_timeout``, a frame complete
  within ``frame_timeout`` of its first byte (``Session`` enforces it while it reads). When
  the process runs out of file descriptors (EMFILE/ENFILE) accepting keeps going: the
  error is counted, a spare descriptor kept for the purpose lets the daemon tell the
  waiting peer so and close it, and accepting resumes as soon as descriptors free up.

TLS (``tls``, a ``kvstore.tls.TLSConfig``): every accepted socket is wrapped, its handshake
left to the session's non-blocking steps (``kvstore.net.session``), so a peer that stalls it
holds no thread; a client certificate of the configured CA is required. A connection over
the limits is still refused with a plain error frame before any handshake, which a TLS
client reads as a failed handshake (``StoreUnavailable``).

A connection's reservations and pins are made with its ``Session`` as their ``owner`` and
released (``BlockStore.release_owner``) when it ends, however it ends (clean close, bad
input, a dead peer, a timeout). Bad input closes that connection only. ``shutdown()`` stops
accepting, closes waiting connections, lets every connection in a serving thread finish the
operation it is in, then returns; the caller closes the store afterwards.
"""

from __future__ import annotations

import errno
import logging
import os
import queue
import resource
import select
import socket
import threading
import time
from typing import TYPE_CHECKING, Any

from kvstore.net import protocol as P
from kvstore.net import sockio
from kvstore.net.frames import Close, FrameTimeout
from kvstore.net.host_id import local_host_id
from kvstore.net.limits import ServerLimits
from kvstore.net.session import Session
from kvstore.net.session_host import DropReason, ServerMetrics
from kvstore.net.ucx import Worker
from kvstore.node.store import BlockStore

if TYPE_CHECKING:
    from kvstore.tls import TLSConfig

__all__ = ["ServerLimits", "StoreServer", "raise_nofile_limit"]

log = logging.getLogger(__name__)

_ARM = select.EPOLLIN | select.EPOLLONESHOT
_ARM_OUT = select.EPOLLOUT | select.EPOLLONESHOT  # a TLS step that waits to write
_ACCEPT_BURST = 64
LINGER_MS = 1  # poll's granularity: the least wait above none
_FD_ERRNOS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


def raise_nofile_limit(want: int) -> int:
    """Raise this process's soft RLIMIT_NOFILE towards ``want`` (never above the hard
    limit); returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft


class StoreServer:
    """Serves one ``BlockStore`` over the kvstore protocol (module docstring).

    ``metrics`` (optional, a ``ServerMetrics``) receives the server's observations.
    Construction has no side effects; ``bind()`` opens the listening socket and
    ``serve_forever()`` serves until ``shutdown()``.
    """

    def __init__(self, store: BlockStore, *, host: str, port: int, node_id: str,
                 auth_token: str | None = None, limits: ServerLimits | None = None,
                 metrics: ServerMetrics | None = None, tls: TLSConfig | None = None,
                 ucx: bool = False) -> None:
        self.store = store
        self.node_id = node_id
        self.host_id = local_host_id()
        self.limits = limits = limits or ServerLimits()
        self.max_reserve = limits.max_conn_reserve or max(
            P.MAX_BATCH, int(limits.conn_reserve_fraction * store.arena.size))
        self.token = auth_token.encode() if auth_token else None
        self.metrics = metrics
        self.tls = tls
        if ucx and tls is not None:
            raise ValueError("UCX moves block bytes unencrypted: serve it without TLS (kvstore.net.ucx)")
        self._want_ucx = ucx
        self.ucx: Worker | None = None  # made by bind() when asked for
        self._ssl = tls.server_context() if tls is not None else None
        self.address: tuple[str, int] | None = None
        self.accept_errors = 0
        self._host, self._port = host, port
        self._listener: socket.socket | None = None
        self._ep: Any = None  # select.epoll, while serve_forever runs
        self._stopping = threading.Event()
        self._sessions: dict[int, Session] = {}  # by file descriptor
        self._lock = threading.Lock()  # guards _sessions and every session's state
        self._queue: queue.SimpleQueue[Session | None] = queue.SimpleQueue()
        self._workers: list[threading.Thread] = []
        self._idle_workers = 0
        self._pool_lock = threading.Lock()
        self._spare: int | None = None
        self._last_fd_warning = 0.0
        self._started = time.monotonic()

    # --- lifecycle ----------------------------------------------------------------------

    def bind(self) -> tuple[str, int]:
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self._host, self._port))
            sock.listen(1024)
        except BaseException:
            sock.close()
            raise
        sock.setblocking(False)
        if self._want_ucx and self.ucx is None:
            try:
                self.ucx = Worker()
            except BaseException:
                sock.close()
                raise
        self._listener = sock
        address: tuple[str, int] = sock.getsockname()[:2]
        self.address = address
        return address

    def serve_forever(self) -> None:
        listener = self._listener
        assert listener is not None, "bind() first"
        ep = self._ep = select.epoll()
        ep.register(listener.fileno(), select.EPOLLIN)
        paused_until: float | None = None
        L = self.limits
        tick = max(0.01, min(0.25, L.hello_timeout / 4, L.idle_timeout / 4, L.frame_timeout / 4))
        next_sweep = time.monotonic() + tick
        try:
            self._spare = os.open(os.devnull, os.O_RDONLY)
        except OSError:
            self._spare = None
        try:
            while not self._stopping.is_set():
                for fd, _ in ep.poll(tick):
                    if fd == listener.fileno():
                        if not self._accept(listener):  # out of descriptors, no spare: back off
                            ep.unregister(fd)
                            paused_until = time.monotonic() + 0.1
                        continue
                    s = self._sessions.get(fd)
                    if s is not None and s.state == "idle":  # only this thread leaves "idle"
                        s.state = "busy"
                        self._submit(s)
                now = time.monotonic()
                if paused_until is not None and now >= paused_until:
                    ep.register(listener.fileno(), select.EPOLLIN)
                    paused_until = None
                if now >= next_sweep:
                    self._sweep(now)
                    next_sweep = now + tick
        finally:
            listener.close()
            with self._lock:
                idle = [s for s in self._sessions.values() if s.state == "idle"]
            for s in idle:
                self._close(s)
            self._ep = None
            ep.close()
            if self._spare is not None:
                os.close(self._spare)
                self._spare = None

    def stop_accepting(self) -> None:
        self._stopping.set()

    def shutdown(self, timeout: float = 10.0) -> bool:
        """Stop accepting, close waiting connections and wait up to ``timeout`` for every
        busy one to finish its current operation and close. True when all did."""
        self._stopping.set()
        deadline = time.monotonic() + timeout
        done = False
        while time.monotonic() < deadline:
            with self._lock:
                if not self._sessions:
                    done = True
                    break
            time.sleep(0.02)
        for _ in self._workers:
            self._queue.put(None)
        if not done:
            log.warning("%d connection(s) still busy after %.1fs", self.connection_count, timeout)
        elif self.ucx is not None:  # every session closed its endpoint: stop the progress thread
            self.ucx.close()
        return done

    @property
    def connection_count(self) -> int:
        return len(self._sessions)

    def server_stats(self) -> dict[str, Any]:
        return {"node_id": self.node_id, "host_id": self.host_id,
                "address": f"{self.address[0]}:{self.address[1]}" if self.address else None,
                "connections": self.connection_count, "serving_threads": len(self._workers),
                "max_data": self.max_reserve, "accept_errors": self.accept_errors,
                "ucx": self.ucx is not None,
                "uptime_s": round(time.monotonic() - self._started, 3)}

    # --- accepting ----------------------------------------------------------------------

    def _accept(self, listener: socket.socket) -> bool:
        """Accept what waits; False when out of file descriptors with no spare left."""
        for _ in range(_ACCEPT_BURST):
            try:
                sock, peer = listener.accept()
            except (BlockingIOError, InterruptedError):
                return True
            except OSError as e:
                if e.errno in _FD_ERRNOS:
                    if not self._out_of_fds(listener, e):
                        return False
                    continue
                if e.errno not in (errno.ECONNABORTED, errno.EPROTO, errno.EPERM):
                    log.warning("accept failed: %s", e)
                continue
            if len(self._sessions) >= self.limits.max_connections:
                self._refuse(sock, "limit", f"this daemon serves at most {self.limits.max_connections} "
                             "connections (--max-connections); retry later or use another node")
                continue
            try:
                sockio.tune_socket(sock, self.limits.frame_timeout)
                if self._ssl is not None:  # the handshake is the session's first steps
                    sock.settimeout(0.0)
                    sock = self._ssl.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
                s = Session(self, sock, peer, time.monotonic())
                with self._lock:
                    self._sessions[s.fd] = s
                self._ep.register(s.fd, _ARM)
            except OSError as e:
                log.warning("could not set up connection %s: %s", peer, e)
                sock.close()
        return True

    def _out_of_fds(self, listener: socket.socket, exc: OSError) -> bool:
        """EMFILE/ENFILE from accept: count it; with the spare descriptor, accept the peer
        to tell it so and close it. False when there is no spare (the caller backs off)."""
        self.accept_errors += 1
        if self.metrics is not None:
            self.metrics.accept_error()
        now = time.monotonic()
        if now - self._last_fd_warning > 5.0:
            self._last_fd_warning = now
            log.warning("out of file descriptors (%s) with %d connections open; refusing new ones "
                        "until some close (raise `ulimit -n` or lower --max-connections)",
                        exc.strerror, self.connection_count)
        if self._spare is None:
            return False
        os.close(self._spare)
        self._spare = None
        try:
            sock, _ = listener.accept()
        except OSError:
            sock = None
        if sock is not None:
            self._refuse(sock, "fd_exhausted", "the kvstore daemon is out of file descriptors; "
                         "retry later or use another node")
        try:
            self._spare = os.open(os.devnull, os.O_RDONLY)
        except OSError:
            return False
        return sock is not None

    def _refuse(self, sock: socket.socket, reason: DropReason, message: str) -> None:
        """Tell a peer we do not serve it (an UNAVAILABLE frame, request id 0) and close."""
        meta = P.pack_error(P.ErrorCode.UNAVAILABLE, message)
        try:
            sock.send(P.pack_header(P.Op.HELLO, P.FLAG_RESPONSE | P.FLAG_ERROR, 0, len(meta)) + meta,
                      socket.MSG_DONTWAIT)
            sock.shutdown(socket.SHUT_WR)
            sock.recv(P.MAX_HELLO_META, socket.MSG_DONTWAIT)  # what it sent: no RST over our frame
        except OSError:
            pass
        sock.close()
        if self.metrics is not None:
            self.metrics.dropped(reason)

    # --- serving ------------------------------------------------------------------------

    def _submit(self, s: Session) -> None:
        self._queue.put(s)
        with self._pool_lock:
            grow = (self._queue.qsize() > self._idle_workers
                    and len(self._workers) < self.limits.threads)
            if grow:
                self._idle_workers += 1  # counted idle from now: one new thread per waiting session
                t = threading.Thread(target=self._work, name=f"kvstore-serve-{len(self._workers)}",
                                     daemon=True)
                self._workers.append(t)
        if grow:
            t.start()

    def _work(self) -> None:
        while True:
            s = self._queue.get()
            with self._pool_lock:
                self._idle_workers -= 1
            if s is None:
                return
            self._serve(s)
            with self._pool_lock:
                self._idle_workers += 1

    def _serve(self, s: Session) -> None:
        reason: DropReason | None = None
        try:
            s.step()
            while self._linger(s):
                s.step()
        except Close:
            pass
        except (FrameTimeout, BlockingIOError, TimeoutError) as e:
            log.info("closing connection %s: %s", s.peer, e or "frame deadline (I/O timeout)")
            reason = "frame_timeout"
        except OSError as e:  # ConnectionError included: a dead or truncating peer
            log.debug("connection %s dropped: %s", s.peer, e)
        except Exception:  # a bug: log it, but never take the daemon down with one connection
            log.exception("connection %s failed", s.peer)
        else:
            if s.buffered() and not self._stopping.is_set():  # TLS bytes epoll cannot see
                self._submit(s)
                return
            with self._lock:
                if not self._stopping.is_set() and s.state == "busy":
                    s.state = "idle"
                    try:
                        self._ep.modify(s.fd, _ARM_OUT if s.want_write else _ARM)
                        return
                    except (OSError, ValueError, AttributeError):
                        s.state = "busy"
        self._close(s, reason)

    def _linger(self, s: Session) -> bool:
        """Wait up to ``LINGER_MS`` on this thread for ``s``'s next request (module
        docstring); True when it came. Never while others wait for a thread, when no thread
        would be left for one, on TLS, before HELLO or while stopping."""
        if s.tls or not s.authed or self._stopping.is_set():
            return False
        with self._pool_lock:
            if not self._queue.empty() or (self._idle_workers == 0
                                           and len(self._workers) >= self.limits.threads):
                return False
        p = select.poll()
        p.register(s.fd, select.POLLIN)
        return bool(p.poll(LINGER_MS))

    def _sweep(self, now: float) -> None:
        """Close waiting connections past a deadline (class docstring of ``ServerLimits``)."""
        L = self.limits
        expired: list[tuple[Session, DropReason]] = []
        for s in list(self._sessions.values()):
            if s.state != "idle":
                continue
            if s.frame_started is not None and now - s.frame_started > L.frame_timeout:
                expired.append((s, "frame_timeout"))
            elif not s.authed and now - s.opened > L.hello_timeout:
                expired.append((s, "hello_timeout"))
            elif now - s.last_active > L.idle_timeout:
                expired.append((s, "idle_timeout"))
        for s, reason in expired:
            log.info("closing connection %s: %s", s.peer, reason.replace("_", " "))
            self._close(s, reason)

    def _close(self, s: Session, reason: DropReason | None = None) -> None:
        with self._lock:
            if s.state == "closed":
                return
            s.state = "closed"
            if self._sessions.get(s.fd) is s:
                del self._sessions[s.fd]
        s.release()
        s.sock.close()  # also leaves the epoll set
        if reason is not None and self.metrics is not None:
            self.metrics.dropped(reason)
