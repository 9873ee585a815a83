"""The same-host CUDA IPC path of ``Client`` (``Client.get_cuda``/``put_cuda``).

The daemon's GPU tier buffer is mapped into this process once per connection (``Link``: the
GPU_HANDLE answer opened with ``kvstore.node.cuda_ipc.open_buffer``); blocks then move device
to device between the caller's CUDA tensors and the mapped buffer, and only keys and offsets
cross the socket (the ops are ``kvstore.net.gpu_ops``'):

- get: GPU_PIN (offsets of the blocks in the GPU tier, pinned for this connection), a
  ``copy_`` out of the mapped buffer per block, a device synchronize (the copies are done
  before the daemon may reuse the space), GPU_UNPIN.
- put: GPU_RESERVE (offsets to write; MISSING where the store holds the key already), a
  ``copy_`` into the mapped buffer per block, a synchronize, GPU_COMMIT (GPU_ABORT if a copy
  failed).

The daemon offers it (HELLO's ``"cuda_ipc"``) only with a CUDA GPU tier on this host;
otherwise, and in a process without CUDA, these raise ``kvstore.errors.Unsupported``. torch
is never imported here: it is the one the caller's tensors come from. Each function runs on
one connection under the client's lock.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from kvstore.errors import Unsupported
from kvstore.net import protocol as P
from kvstore.net.connection import Connection
from kvstore.node import cuda_ipc

__all__ = ["Link", "link", "flat", "get", "put"]


class Link:
    """The daemon's GPU tier buffer, mapped for one connection."""

    __slots__ = ("conn", "buf", "max_reserve", "_torch")

    def __init__(self, conn: Connection, torch: Any, info: dict[str, Any]) -> None:
        self.conn = conn
        self._torch = torch
        self.buf = cuda_ipc.open_buffer(info)
        self.max_reserve = int(info.get("max_reserve", info["nbytes"]))

    def sync(self, tensors: Sequence[Any]) -> None:
        """Wait for the copies issued on the devices of the mapped buffer and of ``tensors``."""
        for device in {self.buf.device, *(t.device for t in tensors)}:
            self._torch.cuda.synchronize(device)


def link(conn: Connection, current: Link | None) -> Link:
    """``current`` if it maps ``conn``'s daemon buffer, else a new mapping (GPU_HANDLE)."""
    if current is not None and current.conn is conn:
        return current
    torch = cuda_ipc.require_cuda()
    if not conn.hello.get("cuda_ipc"):
        raise Unsupported("the daemon does not offer CUDA IPC to this client: it needs a GPU tier "
                          "on CUDA (kvstore serve --gpu-memory SIZE) on this same host")
    _, meta = conn.exchange(P.Op.GPU_HANDLE, b"")
    return Link(conn, torch, P.unpack_json(meta))


def flat(torch: Any, t: Any, i: int) -> Any:
    """A contiguous CUDA tensor as a flat uint8 view (``ValueError`` for anything else)."""
    if not getattr(t, "is_cuda", False):
        raise ValueError(f"tensor {i} is not a CUDA tensor: get_cuda/put_cuda take CUDA tensors "
                         "(Client.get/put take anything else)")
    if not t.is_contiguous():
        raise ValueError(f"tensor {i} is not contiguous; call .contiguous() first")
    return t.detach().reshape(-1).view(torch.uint8)


def get(conn: Connection, ln: Link, keys, dsts: list[Any]) -> list[bool]:
    """GPU_PIN, copy each block the GPU tier holds into its tensor, sync, GPU_UNPIN."""
    n = len(keys)
    _, meta = conn.exchange(P.Op.GPU_PIN, P.pack_keys(keys), expect=16 * n)
    arr = np.frombuffer(meta, "<u8")
    offsets, sizes = arr[:n].tolist(), arr[n:].tolist()
    held = [k for k, s in zip(keys, sizes) if s != P.MISSING]
    try:
        for i, (d, off, s) in enumerate(zip(dsts, offsets, sizes)):
            if s == P.MISSING:
                continue
            if s > d.numel():
                raise ValueError(f"tensor {i} holds {d.numel()} bytes, its block is {s}")
            d[:s].copy_(ln.buf[off: off + s], non_blocking=True)
        ln.sync(dsts)
    finally:
        if held:
            conn.exchange(P.Op.GPU_UNPIN, P.pack_keys(held), expect=0)
    return [s != P.MISSING for s in sizes]


def put(conn: Connection, ln: Link, keys, srcs: list[Any]) -> list[bool]:
    """GPU_RESERVE, copy each block the store lacks into its slot, sync, GPU_COMMIT; per
    key, whether this call wrote it (False: the store holds it already)."""
    sizes = [s.numel() for s in srcs]
    _, meta = conn.exchange(P.Op.GPU_RESERVE, P.pack_keys_sizes(keys, sizes), expect=8 * len(keys))
    offsets = np.frombuffer(meta, "<u8").tolist()
    mine = [k for k, off in zip(keys, offsets) if off != P.MISSING]
    try:
        for src, off in zip(srcs, offsets):
            if off != P.MISSING:
                ln.buf[off: off + src.numel()].copy_(src, non_blocking=True)
        ln.sync(srcs)
    except BaseException:
        if mine:
            conn.exchange(P.Op.GPU_ABORT, P.pack_keys(mine), expect=0)
        raise
    if mine:
        conn.exchange(P.Op.GPU_COMMIT, P.pack_keys(mine), expect=0)
    return [off != P.MISSING for off in offsets]
