"""The UCX data path (``ucxx``): block bytes as tagged UCX messages, control on the socket.

A connection that uses UCX is an ordinary kvstore connection (``kvstore.net.protocol``):
the socket carries HELLO, the cluster secret, every request and every answer, and its life
is the session's life. Only block values move over UCX, as one tagged message a block, sent
from where the block lies into where it goes: a GET's blocks from their pinned arena slots
into the caller's buffers, a PUT's values into their reserved arena slots. UCX's rendezvous
protocol moves a large tagged message with no intermediate copy (RDMA where the hardware
has it; without RDMA hardware UCX runs over TCP: docs/decisions/0059-transports.md). So every
guarantee of the TCP path holds unchanged: authentication, typed errors, bad input closing
one connection, and whatever a connection reserved or pinned dying with its socket.

Setting up (after HELLO succeeded; before it the daemon answers nothing but HELLO):

- HELLO's answer carries ``"ucx": true`` when the daemon serves UCX (``kvstore serve
  --ucx``); a store's etcd registration lists ``"ucx"`` in its ``"transports"``.
- The client sends ``UCX`` (op 14), meta JSON ``{"address": <its worker address, hex>,
  "prefix": <u32>}``; the answer is ``{"address": <the daemon's worker address, hex>,
  "prefix": <u32>}``. Each side then has an endpoint to the other's worker. No worker address
  crosses before the peer proved the cluster secret, nor to a daemon that refused it.

Tags (u64): ``prefix << 32 | (request id & 0xffff) << 16 | i``, where ``prefix`` is the
*receiver's* (never reused by the receiving worker) and ``i`` the block's
index among the request's keys (< ``MAX_BATCH``). A receiver posts a receive for exactly the
tags it expects, so unsolicited tags are never matched.

Requests with ``FLAG_UCX`` (bit 3), on a connection set up as above only:

- ``GET``: the answer's meta is the sizes, as over TCP, with no data on the socket; the
  daemon then sends each present block, tag ``i`` its index among the keys, and unpins the
  blocks only once every send completed (or was cancelled with the endpoint). The client
  posts its receives once it knows the sizes.
- ``RESERVE``: as on shared memory (offsets, ``MISSING`` for present keys); the daemon posts
  a receive into each reserved slot, and the client sends each value it got an offset for
  (tag ``i``), then ``COMMIT``s those keys: the daemon waits (within the frame deadline) for
  their receives before it commits. An ``ABORT`` of keys whose receives are posted is a
  PROTOCOL error: the client drops the connection instead, and its end closes the endpoint.

Limits of what the daemon can check: ucxx does not report a tagged receive's length, so a
value shorter than its RESERVE declared lands short and the rest of its slot is undefined (a
longer one fails the COMMIT: truncated); the connector's codec check on read makes such a
block a miss. Messages no receive asked for wait in UCX's unexpected queue: only peers that
proved the cluster secret ever learn the daemon's worker address.

When a session ends, the daemon closes its endpoint, which cancels every receive and send
still posted, and waits for them to finish before it frees a slot; a slot whose request did
not finish in time is left reserved or pinned (a leak, logged) rather than reused under a
late write. Without TLS only: UCX moves bytes in the clear, so a TLS client never asks for it
and ``kvstore serve`` refuses ``--ucx`` with ``--tls-cert``.

Progress: one worker in the daemon, one per connection in a client (``Link``: why), each
progressed by UCX's own thread in blocking mode (it sleeps in ``epoll`` until
the worker has events); callers wait for a request by polling its state with a sleep that
backs off to ``_MAX_PAUSE``.
"""

from __future__ import annotations

import atexit
import os
import random
import threading
import time
import weakref
from typing import Any, Callable, Sequence

__all__ = ["available", "Worker", "Endpoint", "Link", "tag", "wait", "UcxError"]

_MAX_PAUSE = 256e-6  # the longest sleep between two looks at a request (the first: 1 us)
_CLOSE_WAIT = 5.0  # how long a closing endpoint waits for its cancelled requests


class UcxError(ConnectionError):
    """A UCX transfer failed, was cancelled or timed out: the connection is out of step."""


_import_error: str | None = None
_lib: Any = None
_Array: Any = None


def available() -> str | None:
    """None when ``ucxx`` imports here; else why not (a skip reason, an error message)."""
    global _import_error, _lib, _Array
    if _lib is None and _import_error is None:
        os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
        try:
            from ucxx._lib import libucxx  # type: ignore[import-not-found]
            from ucxx._lib.arr import Array  # type: ignore[import-not-found]
        except Exception as e:  # noqa: BLE001 - ImportError, or a library that does not load
            _import_error = (f"ucxx is not importable ({e}); install the ucx extra: "
                             "pip install 'kvcache-store[ucx]'")
        else:
            _lib, _Array = libucxx, Array
    return _import_error


def tag(prefix: int, rid: int, i: int) -> int:
    return (prefix << 32) | ((rid & 0xFFFF) << 16) | i


def _settle(reqs: Sequence[Any], deadline: float, idle: float | None = None,
            abort: Callable[[], bool] | None = None) -> bool:
    """Wait until every request completed (True) or ``deadline`` (monotonic) passed or
    ``abort()`` (asked once the pause is at its longest) said so (False); with ``idle``, the
    deadline moves to ``idle`` seconds after each completion."""
    pause = 1e-6
    for r in reqs:
        while not r.completed:
            if time.monotonic() > deadline or (pause >= _MAX_PAUSE and abort is not None and abort()):
                return False
            time.sleep(pause)
            pause = min(pause * 2, _MAX_PAUSE)
        if idle is not None:
            deadline = time.monotonic() + idle
    return True


def wait(reqs: Sequence[Any], deadline: float, idle: float | None = None,
         abort: Callable[[], bool] | None = None) -> None:
    """Wait until every request completed, then raise ``UcxError`` for the first that
    failed; ``UcxError`` at ``deadline`` (monotonic; with ``idle``, ``idle`` seconds after
    the last completion, as a socket timeout bounds each wait), or once ``abort()`` is true
    (the daemon: its client's socket hung up), if some are still in flight."""
    if not _settle(reqs, deadline, idle, abort):
        raise UcxError("a UCX transfer did not complete in time, or its peer went away")
    for r in reqs:
        try:
            r.check_error()
        except Exception as e:  # noqa: BLE001 - whatever ucxx raises becomes UcxError
            raise UcxError(f"a UCX transfer failed: {type(e).__name__}: {e}") from None


class Endpoint:
    """One endpoint to a peer's worker, tracking what it posted until ``close``."""

    def __init__(self, ep: Any) -> None:
        self._ep = ep
        self._inflight: list[tuple[Any, Any]] = []  # (request, its buffer)
        self.stuck = False  # close() could not see a posted request finish

    def _open(self) -> Any:
        if self._ep is None:
            raise UcxError("the UCX endpoint is closed")
        return self._ep

    def send(self, views: Sequence[Any], tags: Sequence[int]) -> list[Any]:
        """Post one tagged send a view (the views stay untouched until their requests end)."""
        ep = self._open()
        arrays = [_Array(v) for v in views]
        reqs = [ep.tag_send(a, _lib.UCXXTag(t)) for a, t in zip(arrays, tags)]
        self._track(reqs, arrays)
        return reqs

    def recv(self, views: Sequence[Any], tags: Sequence[int]) -> list[Any]:
        """Post one tagged receive a view (written until its request ends, or is cancelled)."""
        ep = self._open()
        arrays = [_Array(v) for v in views]
        reqs = [ep.tag_recv(a, _lib.UCXXTag(t)) for a, t in zip(arrays, tags)]
        self._track(reqs, arrays)
        return reqs

    def _track(self, reqs: list[Any], arrays: list[Any]) -> None:
        """Hold each request with its buffer until it ended: UCX reads or writes the memory
        by address, and a request does not keep its buffer alive (a caller's temporary, such
        as a value's parts joined for one send, would be freed and reused mid-transfer)."""
        live = [(r, a) for r, a in self._inflight if not r.completed]
        live += zip(reqs, arrays)
        self._inflight = live

    def close(self) -> bool:
        """Close the endpoint (cancelling what it has posted) and wait for its requests to
        finish; True when all did (their buffers are free to reuse)."""
        if self._ep is None:
            return not self.stuck
        ep, self._ep = self._ep, None
        try:
            ep.close_blocking()
        except Exception:  # noqa: BLE001 - closing an endpoint whose peer is gone
            pass
        self.stuck = not _settle([r for r, _ in self._inflight], time.monotonic() + _CLOSE_WAIT)
        if not self.stuck:  # a request UCX may still touch keeps its buffer for good
            self._inflight = []
        return not self.stuck


class Worker:
    """A UCX context and worker, progressed by UCX's thread in blocking mode."""

    def __init__(self) -> None:
        reason = available()
        if reason is not None:
            raise RuntimeError(reason)
        self._worker = _lib.UCXWorker(_context())
        self._worker.start_progress_thread(polling_mode=False)
        self.address: bytes = self._worker.address.tobytes()
        self._next_prefix = random.getrandbits(32)
        self._lock = threading.Lock()
        self._closed = False
        _live.add(self)

    def new_prefix(self) -> int:
        """A tag prefix this worker has not given out before (a counter from a random start,
        never 0, so a message left over from a closed session matches no later one)."""
        with self._lock:
            p = self._next_prefix or 1
            self._next_prefix = (p + 1) & 0xFFFFFFFF
            return p

    def endpoint(self, address: bytes) -> Endpoint:
        """An endpoint to the worker at ``address`` (``ValueError`` if it is not one)."""
        try:
            addr = _lib.UCXAddress.create_from_buffer(address)
            return Endpoint(_lib.UCXEndpoint.create_from_worker_address(self._worker, addr, True))
        except Exception as e:  # noqa: BLE001 - whatever ucxx raises on bad bytes is bad input
            raise ValueError(f"not a UCX worker address ({type(e).__name__}: {e})") from None

    def close(self) -> None:
        """Stop the progress thread (endpoints first: ``Endpoint.close``)."""
        if not self._closed:
            self._closed = True
            self._worker.stop_progress_thread()


_ctx: Any = None
_ctx_lock = threading.Lock()
_live: "weakref.WeakSet[Worker]" = weakref.WeakSet()


@atexit.register
def _close_live() -> None:
    """Stop the progress threads of workers still open at exit (a Client never closed)."""
    for w in list(_live):
        w.close()


def _context() -> Any:
    """This process's UCX context (made once; every worker shares it)."""
    global _ctx
    with _ctx_lock:
        if _ctx is None:
            _ctx = _lib.UCXContext(feature_flags=(_lib.Feature.TAG, _lib.Feature.WAKEUP))
        return _ctx


class Link:
    """A client connection's UCX side: a worker of its own (``worker``, given), its endpoint
    to the daemon's worker, the prefix of the tags it receives (``prefix``) and of those the
    daemon receives (``peer_prefix``). A worker per connection, not one per process: the
    daemon makes an endpoint back to the client's worker for each session, and UCX cannot
    tell two endpoints between the same two workers apart when one of them closes (a closing
    session's endpoint failed another session's transfers when clients shared a worker)."""

    def __init__(self, worker: Worker, address: bytes, prefix: int, peer_prefix: int) -> None:
        self.ep = worker.endpoint(address)
        self.prefix = prefix
        self.peer_prefix = peer_prefix
        self._worker = worker

    def close(self) -> None:
        """Close the endpoint (its cancelled receives no longer write into a caller's
        buffer), then stop the worker's progress thread."""
        self.ep.close()
        self._worker.close()
