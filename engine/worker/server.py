"""The worker's HTTP API (FastAPI), per "Worker HTTP API" in docs/architecture.md.

- ``POST /generate``: body ``GenerateRequest``; 400 names the bad field or value (malformed
  JSON, ids outside the vocabulary, prompt + max_tokens beyond the context), 503 while the
  worker drains, 409 when the request's ``block_keys`` differ from this worker's keys for the
  prompt (the prefill worker and this one disagree on model, layout or salt). Otherwise an
  NDJSON stream of ``GenerateChunk`` lines and one final ``GenerateFinal`` line. A client that
  disconnects aborts its request.
- ``POST /abort`` ``{"request_id"}``: abort (idempotent; unknown ids are a no-op).
- ``GET /events?since=SEQ``: NDJSON stream of events after ``SEQ`` (without ``since``: from
  now on); it ends when the worker shuts down. ``GET /snapshot``: the resync point.
- ``GET /info`` (``WorkerInfo``), ``GET /health`` (200 ok, 503 draining or engine dead),
  ``GET /metrics`` (Prometheus text from the worker's own registry).
- ``POST /role`` ``{"role": "prefill"|"decode"|"colocated"}``: change the role at run time,
  drained first (``engine.worker.role``): 202 with ``GET /role``'s body once the registration
  says draining (200 when it took effect at once: the same role, or to ``colocated``), 409
  while another change runs, 503 when the worker shuts down or etcd could not be told.
  ``GET /role``: ``{"role", "target", "state": "serving"|"draining", "in_flight",
  "draining_s", "changes", "last"}``.

Authentication: given the cluster secret (``kvstore.secret``), every path but ``/health`` and
``/metrics`` requires ``Authorization: Bearer <secret>`` (``kvstore.http_auth.BearerGate``,
constant time) and answers 401 ``{"error"}`` otherwise, before the request reaches a handler
(unknown paths too). Without
a secret nothing is checked: loopback dev mode (``kvengine serve`` refuses to listen beyond
loopback without one unless ``--insecure``).

Addressing: a caller may name the worker it means in ``X-KV-Worker-Id`` (the router does, on
every call). Any other id than this worker's answers 421 ``{"error"}`` before a handler runs:
a registration outlives a killed worker by its lease TTL, and its replacement may bind the
same port, so a stale registration would otherwise reach the new process under an old id,
and a failover from the old id to the new one would send one request to one process twice.

The app only translates between HTTP and the ``EngineWorker``; it never touches the engine.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from engine.api.generate import (
    WORKER_ID_HEADER,
    WORKER_ROLES,
    ApiValidationError,
    GenerateChunk,
    GenerateFinal,
    GenerateRequest,
    WorkerInfo,
)
from engine.core.llm_engine import BlockKeyMismatch
from engine.worker.events import EventStream
from engine.worker.metrics import CONTENT_TYPE_LATEST, WorkerMetrics
from engine.worker.role import RoleBusy, RoleChanger, RolePublishError
from engine.worker.worker import Draining, EngineWorker
from kvstore.http_auth import BearerGate, Gate

__all__ = ["create_app"]

NDJSON = "application/x-ndjson"
_EVENT_BATCH = 1024


def _line(obj: dict[str, Any]) -> bytes:
    return (json.dumps(obj, separators=(",", ":")) + "\n").encode()


def _error(status_code: int, message: str, /, **extra: Any) -> JSONResponse:
    return JSONResponse({"error": message, **extra}, status_code=status_code)


def _unauthorized(reason: str) -> dict[str, str]:
    return {"error": f"unauthorized ({reason}): this worker requires 'Authorization: Bearer "
                     "<cluster secret>' on every path but /health and /metrics"}


class _RequireWorkerId:
    """ASGI middleware: 421 when ``X-KV-Worker-Id`` names another worker (module docstring)."""

    _header = WORKER_ID_HEADER.lower().encode()

    def __init__(self, app: ASGIApp, worker_id: str) -> None:
        self.app = app
        self.worker_id = worker_id

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            meant = next((v.decode("latin-1") for k, v in scope["headers"] if k == self._header), None)
            if meant is not None and meant != self.worker_id:
                response = JSONResponse(
                    {"error": f"misdirected: this is worker {self.worker_id!r}, not {meant!r} "
                              "(a registration that outlived its worker)"}, status_code=421)
                return await response(scope, receive, send)
        return await self.app(scope, receive, send)


def create_app(worker: EngineWorker, info: WorkerInfo, events: EventStream,
               metrics: WorkerMetrics, *, secret: str | None = None,
               roles: RoleChanger | None = None) -> FastAPI:
    """The worker's app. Setting ``app.state.closing`` (an ``asyncio.Event``) ends the
    event streams when set, so a server shutdown is not held open by subscribers.
    ``secret``: the cluster secret every caller must present (None: no authentication).
    ``roles``: the worker's role and its changes (default: one that registers nothing)."""
    app = FastAPI(title="kvengine worker", docs_url=None, redoc_url=None)
    app.add_middleware(_RequireWorkerId, worker_id=info.worker_id)
    if secret:
        app.add_middleware(BearerGate, gates=[Gate("/", (secret,), _unauthorized)])
    roles = roles or RoleChanger(info, in_flight=lambda: worker.in_flight)
    app.state.roles = roles
    app.state.closing = asyncio.Event()  # binds to a loop on first use (Python >= 3.10)

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            metrics.rejected.labels("bad_request").inc()
            return _error(400, f"body is not valid JSON: {exc}")
        try:
            req = GenerateRequest.from_json(body)
        except ApiValidationError as exc:
            metrics.rejected.labels("bad_request").inc()
            return _error(400, str(exc), field=exc.field)
        loop = asyncio.get_running_loop()
        out: asyncio.Queue[GenerateChunk | GenerateFinal] = asyncio.Queue()

        def sink(item: GenerateChunk | GenerateFinal) -> None:  # engine or saver thread
            loop.call_soon_threadsafe(out.put_nowait, item)

        try:
            accepted = worker.submit(req, sink)
        except Draining as exc:
            metrics.rejected.labels("draining").inc()
            return _error(503, str(exc))
        except RuntimeError as exc:
            return _error(503, str(exc))
        try:
            await asyncio.wrap_future(accepted)
        except BlockKeyMismatch as exc:
            return _error(409, str(exc), field="block_keys")
        except ValueError as exc:
            return _error(400, str(exc))
        except RuntimeError as exc:  # the engine thread died meanwhile
            return _error(503, str(exc))

        async def stream() -> AsyncIterator[bytes]:
            finished = False
            try:
                while True:
                    item = await out.get()
                    yield _line(item.to_json())
                    if isinstance(item, GenerateFinal):
                        finished = True
                        return
            finally:
                if not finished:  # the client went away (or the server is stopping)
                    worker.abort(req.request_id)

        return StreamingResponse(stream(), media_type=NDJSON)

    @app.post("/abort")
    async def abort(request: Request) -> Response:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return _error(400, f"body is not valid JSON: {exc}")
        rid = body.get("request_id") if isinstance(body, dict) else None
        if not isinstance(rid, str) or not rid:
            return _error(400, "request_id: expected a non-empty string", field="request_id")
        worker.abort(rid)
        return JSONResponse({"request_id": rid, "aborted": True})

    @app.get("/events")
    async def event_stream(since: int | None = None) -> Response:
        if since is not None and since < 0:
            return _error(400, f"since must be >= 0, got {since}", field="since")
        start = events.seq if since is None else since
        closing: asyncio.Event = app.state.closing

        async def stream() -> AsyncIterator[bytes]:
            seq = start
            while not closing.is_set():
                batch = events.since(seq, limit=_EVENT_BATCH)
                if batch:
                    seq = batch[-1].seq
                    yield b"".join(_line(e.to_json()) for e in batch)
                    continue
                await events.wait_async(seq, timeout=0.5)

        return StreamingResponse(stream(), media_type=NDJSON)

    @app.get("/snapshot")
    async def snapshot() -> Response:
        return JSONResponse(events.snapshot().to_json())

    @app.get("/info")
    async def get_info() -> Response:
        return JSONResponse(roles.info.to_json())

    @app.get("/role")
    async def get_role() -> Response:
        return JSONResponse(roles.state())

    @app.post("/role")
    async def post_role(request: Request) -> Response:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return _error(400, f"body is not valid JSON: {exc}")
        role = body.get("role") if isinstance(body, dict) else None
        if role not in WORKER_ROLES:
            return _error(400, f"role: expected one of {list(WORKER_ROLES)}, got {role!r}", field="role")
        if worker.draining:
            return _error(503, "this worker is shutting down; its role does not change")
        try:
            state = await roles.change(role)
        except RoleBusy as exc:
            return _error(409, str(exc), **roles.state())
        except RolePublishError as exc:
            return _error(503, str(exc))
        return JSONResponse(state, status_code=202 if state["state"] == "draining" else 200)

    @app.get("/health")
    async def health() -> Response:
        if not worker.alive:
            return _error(503, f"engine thread stopped: {worker.error!r}", status="dead")
        if worker.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def get_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app
