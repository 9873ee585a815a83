"""Request bodies the app reads itself: size-limited JSON that never crashes the parser, and the
request models' schemas put back into ``/openapi.json`` (so ``/docs`` shows them)."""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from router.http.errors import BadRequest, PayloadTooLarge

__all__ = ["body_schema", "document_bodies", "read_json_body"]


async def read_json_body(request: Request, limit: int) -> Any:
    """The body as JSON: 413 past ``limit`` bytes (the declared length refused before a byte
    is read, a chunked body as soon as it passes), 400 when it is not JSON or nests deeper
    than the parser goes (a ``RecursionError``, not a crash)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(limit)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise PayloadTooLarge(limit)
    try:
        return json.loads(body)
    except RecursionError:
        raise BadRequest("the request body nests too deeply to be parsed") from None
    except ValueError as exc:   # JSONDecodeError, and bytes that are not UTF-8
        raise BadRequest(f"the request body is not valid JSON: {exc}") from None


def body_schema(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` for an endpoint that reads its body itself: the model's schema, its
    nested models referenced under components (merged in by :func:`document_bodies`)."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    _schemas.update(schema.pop("$defs", {}))
    _schemas[model.__name__] = schema
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


_schemas: dict[str, Any] = {}


def document_bodies(app: FastAPI) -> None:
    """``/openapi.json`` (and so ``/docs``) with the request models of :func:`body_schema`."""
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
            doc.setdefault("components", {}).setdefault("schemas", {}).update(_schemas)
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi
