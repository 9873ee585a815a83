"""The daemon's CUDA IPC ops, GPU_HANDLE to GPU_ABORT (``kvstore.net.protocol``'s table).

Served by a ``Session`` (``kvstore.net.session``) like the store ops (``kvstore.net.store_ops``),
over the store's ``GpuShare`` (``kvstore.node.gpu_share``): only keys, offsets and one handle
cross the socket; the client copies block bytes device to device in the daemon's mapped tier
buffer.

- Offered (HELLO answers ``"cuda_ipc": true``) when the daemon has a GPU tier on CUDA and the
  HELLO's host id is the daemon's own (as the shared-memory path decides). Otherwise every op
  answers UNSUPPORTED (``kvstore.errors.Unsupported``) and the connection goes on serving.
  The pin and reservation ops work on a tier of any device (the tests run one on "cpu"); only
  GPU_HANDLE needs CUDA.
- Pins and reservations are the session's (``owner=session``): released with the rest of
  what it holds when it ends (``BlockStore.release_owner``). An UNPIN, COMMIT or ABORT of
  keys the connection does not hold is bad input: a PROTOCOL error, and the connection closes.
- Nothing here runs before HELLO succeeded (the session refuses every other op first).
"""

from __future__ import annotations

from typing import Any, Callable, Literal, Protocol, TypeVar

import numpy as np

from kvstore.errors import ProtocolError, Unsupported
from kvstore.keys import BlockKey
from kvstore.net import protocol as P
from kvstore.node.gpu_share import GpuPinError, GpuShare
from kvstore.node.store import BlockStore

__all__ = ["HANDLERS", "hello_fields", "Session"]

T = TypeVar("T")


class Session(Protocol):
    """What these ops need of ``kvstore.net.session.Session`` (which imports this module)."""

    store: BlockStore
    same_host: bool  # HELLO's host id is the daemon's

    def reply(self, h: P.Header, meta: bytes = b"", data: list | None = None) -> None: ...

    def count_bytes(self, direction: Literal["in", "out"], path: Literal["cuda_ipc"], nbytes: int) -> None: ...


def hello_fields(s: Session) -> dict[str, Any]:
    """What HELLO's answer says of CUDA IPC for this session."""
    share = s.store.gpu_share
    return {"cuda_ipc": True} if share is not None and share.is_cuda and s.same_host else {}


def _share(s: Session) -> GpuShare:
    share = s.store.gpu_share
    if share is None:
        raise Unsupported("this daemon has no GPU tier, so no CUDA IPC: start it with "
                          "`kvstore serve --gpu-memory SIZE` on a CUDA machine")
    if not s.same_host:
        raise Unsupported("CUDA IPC is for clients on the daemon's own host (HELLO's host id "
                          "differs): use the TCP or UCX path")
    return share


def _handle(s: Session, h: P.Header, meta: memoryview) -> None:
    s.reply(h, P.pack_json(_share(s).handle()))


def _pin(s: Session, h: P.Header, meta: memoryview) -> None:
    keys = P.unpack_keys(meta)
    locs = _share(s).pin(keys, s)
    n = len(keys)
    out = np.full(2 * n, P.MISSING, dtype="<u8")
    nbytes = 0
    for i, loc in enumerate(locs):
        if loc is not None:
            out[i], out[n + i] = loc
            nbytes += loc[1]
    s.count_bytes("out", "cuda_ipc", nbytes)
    s.reply(h, out.tobytes())


def _held(s: Session, meta: memoryview, op: Callable[[GpuShare, list[BlockKey], Session], T]) -> T:
    """``op`` (UNPIN, COMMIT or ABORT) on the keys in ``meta``, which the session must hold:
    keys it does not hold are bad input, a PROTOCOL error (module docstring)."""
    keys = P.unpack_keys(meta)
    try:
        return op(_share(s), keys, s)
    except GpuPinError as e:
        raise ProtocolError(str(e)) from None


def _unpin(s: Session, h: P.Header, meta: memoryview) -> None:
    _held(s, meta, GpuShare.unpin)
    s.reply(h)


def _reserve(s: Session, h: P.Header, meta: memoryview) -> None:
    keys, sizes = P.unpack_keys_sizes(meta)
    offsets = _share(s).reserve(list(zip(keys, sizes)), s)
    s.reply(h, np.fromiter((P.MISSING if o is None else o for o in offsets), dtype="<u8",
                            count=len(offsets)).tobytes())


def _commit(s: Session, h: P.Header, meta: memoryview) -> None:
    s.count_bytes("in", "cuda_ipc", _held(s, meta, GpuShare.commit))
    s.reply(h)


def _abort(s: Session, h: P.Header, meta: memoryview) -> None:
    _held(s, meta, GpuShare.abort)
    s.reply(h)


HANDLERS: dict[int, Callable[[Session, P.Header, memoryview], None]] = {
    P.Op.GPU_HANDLE: _handle, P.Op.GPU_PIN: _pin, P.Op.GPU_UNPIN: _unpin,
    P.Op.GPU_RESERVE: _reserve, P.Op.GPU_COMMIT: _commit, P.Op.GPU_ABORT: _abort,
}
