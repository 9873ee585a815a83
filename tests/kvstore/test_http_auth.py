"""BearerGate, the one HTTP authentication of the worker and the router, on a bare ASGI app:
the first gate whose prefix the path starts with decides, a gate with no token guards nothing,
/health and /metrics stay open, a 401 says why, and what passes reaches the app untouched."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from kvstore.http_auth import OPEN_PATHS, BearerGate, Gate
from kvstore.secret import bearer_headers

STREAM = [{"type": "http.response.start", "status": 200, "headers": []},
          {"type": "http.response.body", "body": b"a\n", "more_body": True},
          {"type": "http.response.body", "body": b"b\n", "more_body": False}]


async def _app(scope: Any, receive: Any, send: Any) -> None:
    for message in STREAM:
        await send(dict(message))


def _call(gate: BearerGate, path: str, headers: dict[str, str] | None = None,
          scope_type: str = "http") -> list[dict[str, Any]]:
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Any) -> None:
        sent.append(message)

    scope = {"type": scope_type, "path": path,
             "headers": [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]}
    asyncio.run(gate(scope, receive, send))
    return sent


def _denied(sent: list[dict[str, Any]]) -> dict[str, Any]:
    start, body = sent
    assert start["status"] == 401
    headers = dict(start["headers"])
    assert headers[b"www-authenticate"] == b"Bearer"
    assert headers[b"content-type"] == b"application/json"
    assert int(headers[b"content-length"]) == len(body["body"])
    return json.loads(body["body"])


def _router_like(cluster_secret: str | None, api_key: str | None) -> BearerGate:
    return BearerGate(_app, [Gate("/admin/", (cluster_secret,), lambda r: {"admin": r}),
                             Gate("/", (api_key,), lambda r: {"api": r})])


def test_the_first_gate_covering_the_path_decides() -> None:
    gate = _router_like("sec", "key")
    assert gate.active
    assert _call(gate, "/admin/scaling", bearer_headers("sec")) == STREAM
    assert _denied(_call(gate, "/admin/scaling", bearer_headers("key"))) == {"admin": "wrong credentials"}
    assert _denied(_call(gate, "/admin/scaling")) == {"admin": "no Authorization header"}
    assert _call(gate, "/v1/models", bearer_headers("key")) == STREAM
    assert _denied(_call(gate, "/v1/models", bearer_headers("sec"))) == {"api": "wrong credentials"}
    assert _denied(_call(gate, "/nowhere")) == {"api": "no Authorization header"}
    for bad in ({"Authorization": "key"}, {"Authorization": "Basic key"},
                {"Authorization": "Bearer key "}, {"Authorization": "bearer key"}):
        assert _denied(_call(gate, "/v1/models", bad))["api"] == "wrong credentials"
    for path in sorted(OPEN_PATHS):
        assert _call(gate, path) == STREAM
    assert _call(gate, "/", scope_type="lifespan") == STREAM


def test_a_gate_without_a_token_guards_nothing() -> None:
    no_secret = _router_like(None, "key")          # /admin/ falls to the API key
    assert _call(no_secret, "/admin/scaling", bearer_headers("key")) == STREAM
    assert _denied(_call(no_secret, "/admin/scaling")) == {"api": "no Authorization header"}
    no_key = _router_like("sec", None)             # the public API is open, /admin/ is not
    assert _call(no_key, "/v1/models") == STREAM
    assert _denied(_call(no_key, "/admin/x")) == {"admin": "no Authorization header"}
    nothing = _router_like(None, None)
    assert not nothing.active and _call(nothing, "/admin/x") == STREAM


def test_every_token_of_a_gate_is_accepted() -> None:
    gate = BearerGate(_app, [Gate("/", ("old", None, "new"), lambda r: {"error": r})])
    assert _call(gate, "/x", bearer_headers("old")) == _call(gate, "/x", bearer_headers("new")) == STREAM
    assert _denied(_call(gate, "/x", bearer_headers("other"))) == {"error": "wrong credentials"}


def test_a_websocket_handshake_is_held_to_the_same_gates() -> None:
    gate = _router_like("sec", "key")
    closed = [{"type": "websocket.close", "code": 1008}]
    assert _call(gate, "/v1/stream", scope_type="websocket") == closed
    assert _call(gate, "/admin/x", bearer_headers("key"), scope_type="websocket") == closed
    assert _call(gate, "/admin/x", bearer_headers("sec"), scope_type="websocket") == STREAM
    assert _call(gate, "/health", scope_type="websocket") == STREAM
