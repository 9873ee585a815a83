"""The store client API an engine relies on: the ``StoreClient`` protocol and ``connect()``.

``StoreClient`` is what ``Client`` (one node, ``kvstore.client.node``) and ``ClusterClient``
(every node registered in etcd, ``kvstore.client.cluster``) both are, and all a caller such
as the engine's connector may count on:

- ``put(keys, values) -> list[bool]``: batch-first; per key, whether it was stored (present
  keys are a successful no-op). A store that cannot fit the whole batch
  stores its longest leading run that fits and answers False for the rest: a full store fails
  the keys that did not fit, never the batch, and never raises for it.
- ``get(keys, buffers) -> list[bool]``: copy each present block into its caller-provided
  buffer (bytes-like, NumPy, torch tensors); ``get_bytes(keys)`` returns copies instead.
- ``contains(keys)``, ``prefix_len(keys)``: lookups that never touch recency.
- ``delete(keys) -> int``: how many stored copies were removed.
- ``stats() -> dict``: the shape differs by client (docs/architecture.md, "Client").
- ``close()`` and use as a context manager.

Failure is the same on both: ``StoreUnavailable`` when no node answered (the engine treats it
as a miss), the typed exceptions of ``kvstore.errors`` otherwise.

``connect()`` picks the client from its arguments. It lives here, not beside ``Client``, so
that neither client module imports the other; it imports ``ClusterClient`` (and with it etcd
and httpx) only when asked for one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, Self, overload, runtime_checkable

from kvstore.client.node import Client
from kvstore.client.transport import Transport

if TYPE_CHECKING:
    from kvstore.client.cluster import ClusterClient

__all__ = ["StoreClient", "connect"]


@runtime_checkable
class StoreClient(Protocol):
    """The batch API shared by ``Client`` and ``ClusterClient`` (module docstring)."""

    def put(self, keys: Sequence[bytes], values: Sequence[Any]) -> list[bool]: ...

    def get(self, keys: Sequence[bytes], buffers: Sequence[Any]) -> list[bool]: ...

    def get_bytes(self, keys: Sequence[bytes]) -> list[bytes | None]: ...

    def contains(self, keys: Sequence[bytes]) -> list[bool]: ...

    def prefix_len(self, keys: Sequence[bytes]) -> int: ...

    def delete(self, keys: Sequence[bytes]) -> int: ...

    def stats(self) -> dict[str, Any]: ...

    def close(self) -> None: ...

    def __enter__(self) -> Self: ...

    def __exit__(self, *exc: object) -> None: ...


@overload
def connect(address: str, *, etcd: None = None, cluster: str = "kvstore",
            auth_token: str | None = None, timeout: float = 5.0, transport: Transport = "auto") -> Client: ...
@overload
def connect(address: None = None, *, etcd: str, cluster: str = "kvstore",
            auth_token: str | None = None, timeout: float = 5.0,
            transport: Transport = "auto") -> ClusterClient: ...
@overload
def connect(address: str | None = None, *, etcd: str | None = None, cluster: str = "kvstore",
            auth_token: str | None = None, timeout: float = 5.0,
            transport: Transport = "auto") -> Client | ClusterClient: ...
def connect(address: str | None = None, *, etcd: str | None = None, cluster: str = "kvstore",
            auth_token: str | None = None, timeout: float = 5.0,
            transport: Transport = "auto") -> StoreClient:
    """A ``Client`` for one node at ``address``, or a ``ClusterClient`` over the nodes
    registered in etcd at ``etcd`` (endpoints URL) under ``cluster``. Pass exactly one.
    ``transport`` picks the data path (``kvstore.client.transport``: ``"auto"`` by the
    transport matrix, or one forced)."""
    if (address is None) == (etcd is None):
        raise ValueError("pass exactly one of address='host:port' or etcd='http://host:port'")
    if address is not None:
        return Client(address, auth_token=auth_token, timeout=timeout, transport=transport)
    assert etcd is not None
    from kvstore.client.cluster import ClusterClient  # etcd and httpx only when asked for

    return ClusterClient(etcd, cluster=cluster, auth_token=auth_token, timeout=timeout,
                         transport=transport)
