"""An async client for one worker's HTTP API (docs/architecture.md, "Worker HTTP API").

- ``generate(request)`` streams :class:`GenerateChunk` lines and ends with exactly one
  :class:`GenerateFinal`; a stream that breaks first raises :class:`WorkerUnavailable` (the
  orchestrator retries or resumes elsewhere), a refused request :class:`WorkerRejected`
  (HTTP 4xx), or :class:`KeyMismatch` for the API's 409 (the worker's block keys for the
  prompt differ from the ``block_keys`` it was given).
- ``abort(request_id)`` frees what a request holds; best effort, never raises.
- ``follow_events(index, on_load)`` keeps a :class:`~router.workers.kv_index.KvIndex` in step with
  the worker's event stream: snapshot, then events from ``snapshot.seq``; on a gap or a
  broken stream it resynchronizes from a fresh snapshot (after ``retry_interval`` if the
  worker could not be reached). Runs until cancelled.

Every call carries ``headers`` (the router passes the cluster secret's
``Authorization: Bearer``, ``kvstore.secret.bearer_headers``: workers refuse callers without it)
and ``X-KV-Worker-Id: <worker_id>``: the worker answers 421 if it is another one (a stale
registration whose port a replacement now holds), which is a :class:`WorkerUnavailable`.

TLS (``kvstore.tls``): a worker at an ``https://`` address is called with the process's TLS
settings (``tls``, by default ``kvstore.tls.current()``): the router presents its certificate
(workers require one) and verifies the worker's against the cluster CA and its address.

Timeouts: connecting and unary calls use ``timeout``; streams use ``stream_read_timeout``
between lines (None: wait forever, e.g. for the event stream of an idle worker).

Every failure to talk to the worker is a :class:`WorkerUnavailable`, whatever raised it:
httpx's transport and stream errors, a line that does not parse, and a client closed under
the call (the pool closes a worker's client when it drops the worker, which can happen while
a request is on its way to it: httpx then raises a bare ``RuntimeError``). So a request
caught in that race fails over like any other.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncGenerator, Callable, Iterator, Mapping
from contextlib import aclosing, contextmanager
from typing import Any, Literal

import httpx

from engine.api.events import (
    LoadEvent,
    LoadFigures,
    Snapshot,
    WorkerEvent,
    parse_event,
)
from engine.api.generate import (
    WORKER_ID_HEADER,
    ApiValidationError,
    GenerateChunk,
    GenerateFinal,
    GenerateRequest,
    WorkerInfo,
    parse_generate_line,
)
from kvstore import tls as tls_settings
from router.workers.kv_index import KvIndex

__all__ = ["WorkerClient", "WorkerError", "WorkerUnavailable", "WorkerRejected", "KeyMismatch"]

log = logging.getLogger(__name__)


class WorkerError(Exception):
    """A worker call failed. ``worker_id`` says which worker."""

    def __init__(self, worker_id: str, message: str) -> None:
        super().__init__(f"worker {worker_id}: {message}")
        self.worker_id = worker_id


class WorkerUnavailable(WorkerError):
    """The worker could not be reached, broke the stream, or answered 5xx: try another."""


class WorkerRejected(WorkerError):
    """The worker refused the request (4xx): retrying elsewhere will not help."""

    def __init__(self, worker_id: str, status: int, message: str) -> None:
        super().__init__(worker_id, f"HTTP {status}: {message}")
        self.status = status


class KeyMismatch(WorkerRejected):
    """The worker's block keys for the prompt differ from the ones it was given (HTTP 409):
    the prefill and decode workers disagree on the model or the KV layout."""


class WorkerClient:
    """One worker's API over a pooled ``httpx.AsyncClient``. Close with ``aclose``."""

    def __init__(self, info: WorkerInfo, *, timeout: float = 5.0,
                 stream_read_timeout: float | None = 300.0, max_connections: int = 1024,
                 headers: Mapping[str, str] | None = None,
                 tls: tls_settings.TLSConfig | Literal[False] | None = None) -> None:
        self.info = info
        self._timeout = timeout
        self._stream_timeout = httpx.Timeout(timeout, read=stream_read_timeout)
        tls = tls_settings.current() if tls is None else (tls or None)
        https = info.address.startswith("https://")
        self._http = httpx.AsyncClient(
            verify=tls.client_context() if tls is not None and https else True,
            base_url=info.address, timeout=timeout,
            headers={**(headers or {}), WORKER_ID_HEADER: info.worker_id},
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=64),
        )

    @property
    def worker_id(self) -> str:
        return self.info.worker_id

    async def aclose(self) -> None:
        await self._http.aclose()

    # --- requests -------------------------------------------------------------------------

    async def generate(self, request: GenerateRequest) -> AsyncGenerator[GenerateChunk | GenerateFinal, None]:
        """Stream one request's output; the last item is always a :class:`GenerateFinal`."""
        with self._failures(f"generate {request.request_id}"):
            async with self._http.stream("POST", "/generate", json=request.to_json(),
                                         timeout=self._stream_timeout) as resp:
                await self._check(resp)
                async for line in resp.aiter_lines():
                    if not line.strip():
                        continue
                    item = parse_generate_line(self._json(line))
                    yield item
                    if isinstance(item, GenerateFinal):
                        return
        raise WorkerUnavailable(self.worker_id,
                                f"generate {request.request_id}: stream ended before its final line")

    async def abort(self, request_id: str) -> bool:
        """Ask the worker to free ``request_id``; False when it could not be told."""
        try:
            with self._failures(f"abort {request_id}"):
                resp = await self._http.post("/abort", json={"request_id": request_id})
            return resp.status_code < 400
        except WorkerUnavailable as exc:
            log.info("abort %s failed: %s", request_id, exc)
            return False

    async def snapshot(self) -> Snapshot:
        """``GET /snapshot``."""
        with self._failures("snapshot"):
            return Snapshot.from_json(await self._get_json("/snapshot"))

    async def health(self) -> bool:
        try:
            with self._failures("health"):
                return (await self._http.get("/health")).status_code == 200
        except WorkerUnavailable:
            return False

    async def events(self, since: int) -> AsyncGenerator[WorkerEvent, None]:
        """``GET /events?since=``: events after ``since``, until the stream ends."""
        timeout = httpx.Timeout(self._timeout, read=None)
        with self._failures("event stream"):
            async with self._http.stream("GET", "/events", params={"since": since},
                                         timeout=timeout) as resp:
                await self._check(resp)
                async for line in resp.aiter_lines():
                    if line.strip():
                        yield parse_event(self._json(line))

    async def follow_events(self, index: KvIndex, on_load: Callable[[LoadFigures], None],
                            *, retry_interval: float = 0.5) -> None:
        """Keep ``index`` in step with this worker until cancelled (see the module docstring)."""
        wid = self.worker_id
        index.add_worker(wid)
        while True:
            try:
                snap = await self.snapshot()
                index.reset(wid, snap)
                on_load(snap.load)
                async with aclosing(self.events(since=snap.seq)) as events:
                    async for event in events:
                        if not index.apply(wid, event):
                            log.info("worker %s: event gap at seq %d; resyncing", wid, event.seq)
                            break
                        if isinstance(event, LoadEvent):
                            on_load(event.load)
                    else:
                        await asyncio.sleep(retry_interval)  # the worker closed the stream
            except WorkerError as exc:
                log.debug("worker %s events: %s; retrying", wid, exc)
                await asyncio.sleep(retry_interval)

    # --- helpers --------------------------------------------------------------------------

    @contextmanager
    def _failures(self, what: str) -> Iterator[None]:
        """Raise every failure to talk to the worker as :class:`WorkerUnavailable` (see the
        module docstring); ``WorkerError`` s pass through."""
        try:
            yield
        except (httpx.HTTPError, httpx.StreamError) as exc:
            raise WorkerUnavailable(self.worker_id, f"{what}: {exc!r}") from exc
        except ApiValidationError as exc:
            raise WorkerUnavailable(self.worker_id, f"{what}: bad message: {exc}") from exc
        except RuntimeError as exc:
            if not self._http.is_closed:
                raise
            raise WorkerUnavailable(self.worker_id, f"{what}: the client is closed (the worker "
                                    f"left the pool): {exc}") from exc

    async def _get_json(self, path: str) -> Any:
        with self._failures(f"GET {path}"):
            resp = await self._http.get(path)
        await self._check(resp)
        return self._json(resp.text)

    async def _check(self, resp: httpx.Response) -> None:
        if resp.status_code < 400:
            return
        await resp.aread()
        text = resp.text[:500]
        if resp.status_code >= 500 or resp.status_code == 421:   # 421: not the worker meant
            raise WorkerUnavailable(self.worker_id, f"HTTP {resp.status_code}: {text}")
        if resp.status_code == 409:
            raise KeyMismatch(self.worker_id, resp.status_code, text)
        raise WorkerRejected(self.worker_id, resp.status_code, text)

    def _json(self, text: str) -> Any:
        try:
            return json.loads(text)
        except ValueError as exc:
            raise WorkerUnavailable(self.worker_id, f"not JSON: {text[:200]!r}") from exc
