"""``AsyncClient``: the asyncio face of ``Client`` (``kvstore.client.node``).

Each call runs a synchronous ``Client`` in a worker thread. Why not a native asyncio
protocol: the data path is a memcpy (shared memory) or a ``recv_into`` the caller's buffer,
both of which release the GIL in a thread; asyncio's stream layer would add a copy per frame
and a second implementation of the protocol. Each of the ``concurrency`` worker threads owns
one ``Client`` (one connection), so that many calls run in parallel and the event loop never
blocks.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import threading
from typing import Any

from kvstore.client.node import Client, Transport

__all__ = ["AsyncClient"]


class AsyncClient:
    """asyncio face of ``Client`` (see the module docstring): same methods, awaitable."""

    def __init__(self, address: str, *, auth_token: str | None = None, timeout: float = 5.0,
                 transport: Transport = "auto", concurrency: int = 4) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        self.address = address
        self._connect = functools.partial(Client, address, auth_token=auth_token, timeout=timeout,
                                          transport=transport)
        self._pool = concurrent.futures.ThreadPoolExecutor(concurrency, "kvstore-async")
        self._local = threading.local()
        self._clients: list[Client] = []
        self._lock = threading.Lock()

    def _client(self) -> Client:
        c = getattr(self._local, "client", None)
        if c is None:
            c = self._local.client = self._connect()
            with self._lock:
                self._clients.append(c)
        return c

    async def _run(self, method: str, *args: Any) -> Any:
        def call() -> Any:
            return getattr(self._client(), method)(*args)

        return await asyncio.get_running_loop().run_in_executor(self._pool, call)

    async def put(self, keys, values) -> list[bool]:
        return await self._run("put", keys, values)

    async def get(self, keys, buffers) -> list[bool]:
        return await self._run("get", keys, buffers)

    async def get_bytes(self, keys) -> list[bytes | None]:
        return await self._run("get_bytes", keys)

    async def contains(self, keys) -> list[bool]:
        return await self._run("contains", keys)

    async def prefix_len(self, keys) -> int:
        return await self._run("prefix_len", keys)

    async def delete(self, keys) -> int:
        return await self._run("delete", keys)

    async def stats(self) -> dict[str, Any]:
        return await self._run("stats")

    async def close(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self._shutdown)

    def _shutdown(self) -> None:
        self._pool.shutdown(wait=True)
        with self._lock:
            for c in self._clients:
                c.close()
            self._clients.clear()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
