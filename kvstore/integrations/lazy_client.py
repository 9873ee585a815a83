"""``LazyClient``: the store client an integration holds, made on first use and again after
``close`` (an integration closes it when a call failed, so the next call reconnects; a store
that is down at the engine's start costs nothing until it is asked)."""

from __future__ import annotations

import threading
from typing import Any, Callable

__all__ = ["LazyClient"]


class LazyClient:
    def __init__(self, make: Callable[[], Any]) -> None:
        self._make = make
        self._client: Any = None
        self._lock = threading.Lock()

    def get(self) -> Any:
        """The client (``kvstore.StoreClient``); raises what making it raised."""
        with self._lock:
            if self._client is None:
                self._client = self._make()
            return self._client

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None
