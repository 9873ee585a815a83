"""What the daemon's server and its sessions agree on: ``SessionHost`` (what a session needs of
its server, ``kvstore.net.server.StoreServer``) and ``ServerMetrics`` (what the server and its
sessions report to as they serve, ``kvstore.daemon.metrics.StoreMetrics``), with the labels of
those reports: ``Direction`` and ``DataPath`` of the bytes moved, ``DropReason`` of a closed
connection.

Types only: the server (``kvstore.net.server``), the session (``kvstore.net.session``) and
the ops it serves (``kvstore.net.store_ops``) import them from here, so none of those imports
another for its types.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, Protocol

from kvstore.net.limits import ServerLimits
from kvstore.node.store import BlockStore

if TYPE_CHECKING:
    from kvstore.net.ucx import Worker

__all__ = ["SessionHost", "ServerMetrics", "Direction", "DataPath", "DropReason"]

Direction = Literal["in", "out"]   # KV bytes put into / got out of the store
DataPath = Literal["tcp", "shm", "ucx", "cuda_ipc"]  # socket / arena / UCX / GPU tier (gpu_ops)
DropReason = Literal["limit", "fd_exhausted", "hello_timeout", "idle_timeout", "frame_timeout",
                     "tls_handshake"]


class ServerMetrics(Protocol):
    """What the server reports to, as it serves (``kvstore.daemon.metrics.StoreMetrics``)."""

    def observe(self, op: str, seconds: float) -> None:
        """One request of ``op`` (a protocol op's name, lower case) took ``seconds``."""

    def transferred(self, direction: Direction, path: DataPath, nbytes: int) -> None:
        """``nbytes`` of values moved."""

    def error(self, code: str) -> None:
        """One error answer of ``code`` (an error code's name, lower case)."""

    def dropped(self, reason: DropReason) -> None:
        """The daemon closed (or refused) one connection for ``reason``."""

    def accept_error(self) -> None:
        """``accept`` failed for want of file descriptors (EMFILE, ENFILE)."""


class SessionHost(Protocol):
    """What a session needs of its server (``kvstore.net.server.StoreServer``)."""

    store: BlockStore
    limits: ServerLimits
    max_reserve: int  # bytes one connection may hold reserved (HELLO's max_data)
    token: bytes | None
    metrics: ServerMetrics | None
    node_id: str
    host_id: str
    ucx: Worker | None  # the daemon's UCX worker, when it serves UCX (kvstore serve --ucx)

    def server_stats(self) -> dict[str, Any]: ...
