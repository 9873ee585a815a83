"""The HTTP servers' one authentication gate: a plain ASGI middleware, shared by the engine
worker (``engine.worker.server``: the cluster secret on every path) and the router
(``router.http.app``: the cluster secret on ``/admin/``, the API key on the rest).

:class:`BearerGate` holds a list of :class:`Gate` s, each a path prefix, the tokens it
accepts and the JSON body its 401 carries. For each HTTP request, the first gate whose prefix
the path starts with decides: the request passes with ``Authorization: Bearer <token>`` for
one of its tokens (compared in constant time), and is answered 401 (that body and
``WWW-Authenticate: Bearer``) otherwise, before any handler or routing runs (unknown paths
too). A WebSocket handshake is held to the same gates and closed (code 1008, before it is
accepted) without the token; neither server serves one, but a route added later must not open
a door. A path that no gate covers passes; so do :data:`OPEN_PATHS` (``/health`` and
``/metrics``: load balancers and scrapers) and the lifespan scope. A gate given no token (a
secret that is not configured) guards nothing: its paths fall to the next gate.

Plain ASGI, not Starlette's ``BaseHTTPMiddleware``: a streamed answer passes through
untouched, and ``kvstore`` needs no web framework (the import contracts forbid it one).
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable, Iterable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

__all__ = ["OPEN_PATHS", "Gate", "BearerGate"]

OPEN_PATHS = frozenset({"/health", "/metrics"})
"""Served without any token."""

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


@dataclass(frozen=True)
class Gate:
    """Paths starting with ``prefix`` need ``Authorization: Bearer <t>`` for a ``t`` in
    ``tokens`` (None entries: not configured, ignored). ``denied(reason)`` is the 401's JSON
    body; ``reason`` is ``"no Authorization header"`` or ``"wrong credentials"``."""

    prefix: str
    tokens: tuple[str | None, ...]
    denied: Callable[[str], Mapping[str, Any]]


class BearerGate:
    """ASGI middleware: the module docstring's gates in front of ``app``. ``active`` is
    False when no gate has a token (then every request passes)."""

    def __init__(self, app: ASGIApp, gates: Iterable[Gate], open_paths: Iterable[str] = OPEN_PATHS) -> None:
        self.app = app
        self.open_paths = frozenset(open_paths)
        accepted = ((g, [f"Bearer {t}".encode() for t in g.tokens if t]) for g in gates)
        self._gates = [(g, tokens) for g, tokens in accepted if tokens]

    @property
    def active(self) -> bool:
        return bool(self._gates)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] not in ("http", "websocket") or path in self.open_paths:
            return await self.app(scope, receive, send)
        gate, accepted = next(((g, tokens) for g, tokens in self._gates
                               if path.startswith(g.prefix)), (None, []))
        if gate is None:
            return await self.app(scope, receive, send)
        header = next((v for k, v in scope["headers"] if k == b"authorization"), None)
        matched = False
        for token in accepted:   # every one compared: the time does not say which matched
            matched |= header is not None and hmac.compare_digest(header, token)
        if matched:
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        reason = "no Authorization header" if header is None else "wrong credentials"
        body = json.dumps(gate.denied(reason), ensure_ascii=False, separators=(",", ":")).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-length", str(len(body)).encode()),
                                (b"content-type", b"application/json"),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})
