"""OpenAI's error objects, and the one place where failures become HTTP statuses.

Every error a client sees is an :class:`OpenAIError`: ``{"error": {"message", "type",
"param", "code"}}`` with its HTTP ``status``. The app raises the HTTP-level ones itself
(:class:`BadRequest` 400 with ``param`` naming the field, :class:`Unauthorized` 401,
:class:`ModelNotFound` 404, :class:`PayloadTooLarge` 413, :class:`TooManyRequests` 429,
:class:`HTTPStatus` for routing's 404 / 405); everything placement and the workers raise goes
through :func:`openai_error`:

======================================  =====================================================
raised below the HTTP layer             answered as
======================================  =====================================================
``NoCapacity`` (placement)              503 ``service_unavailable``: no worker can serve it now
``KeyMismatch`` (a worker's 409)        500 ``internal_error``: prefill and decode workers
                                        disagree on the prompt's block keys (deployment fault)
``WorkerRejected`` (a worker's 4xx)     400 ``invalid_request_error``: the request is wrong
``WorkerError`` (any other)             503: the worker could not be reached
anything else                           None: a bug; the app answers 500 (or, mid-stream, 503)
======================================  =====================================================
"""

from __future__ import annotations

from typing import Any

from router.placement.errors import NoCapacity
from router.workers.client import KeyMismatch, WorkerError, WorkerRejected

__all__ = [
    "OpenAIError",
    "BadRequest",
    "Unauthorized",
    "ModelNotFound",
    "TooManyRequests",
    "ServiceUnavailable",
    "PayloadTooLarge",
    "HTTPStatus",
    "openai_error",
]


class OpenAIError(Exception):
    """An error answered in OpenAI's shape with HTTP ``status``."""

    status = 500
    type = "internal_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.code = message, param, code

    def to_json(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


class BadRequest(OpenAIError):
    status, type = 400, "invalid_request_error"


class Unauthorized(OpenAIError):
    status, type = 401, "invalid_request_error"

    def __init__(self, message: str = "invalid or missing API key (Authorization: Bearer <key>)") -> None:
        super().__init__(message, code="invalid_api_key")


class ModelNotFound(OpenAIError):
    status, type = 404, "invalid_request_error"

    def __init__(self, model: str, served: list[str]) -> None:
        super().__init__(f"the model {model!r} does not exist; this server serves {served}",
                         param="model", code="model_not_found")


class TooManyRequests(OpenAIError):
    status, type = 429, "rate_limit_error"


class ServiceUnavailable(OpenAIError):
    status, type = 503, "service_unavailable"


class PayloadTooLarge(OpenAIError):
    status, type = 413, "invalid_request_error"

    def __init__(self, limit: int) -> None:
        super().__init__(f"the request body exceeds this server's limit of {limit} bytes "
                         "(kvrouter serve --max-body-bytes)", code="request_too_large")


class HTTPStatus(OpenAIError):
    """Any other status the HTTP layer itself answers (an unknown route: 404, a method the
    route does not take: 405), in OpenAI's shape."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.type = "invalid_request_error" if status < 500 else "internal_error"


def openai_error(exc: BaseException) -> OpenAIError | None:
    """What the client sees for ``exc`` (see the module docstring); None for a bug."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, NoCapacity):
        return ServiceUnavailable(str(exc))
    if isinstance(exc, KeyMismatch):
        return OpenAIError(f"the prefill and decode workers disagree on the prompt's block "
                           f"keys: {exc}")
    if isinstance(exc, WorkerRejected):
        return BadRequest(f"the worker refused the request: {exc}")
    if isinstance(exc, WorkerError):
        return ServiceUnavailable(str(exc))
    return None
