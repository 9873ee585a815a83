"""The router's OpenAI-compatible HTTP app (FastAPI).

``create_app(config, pool=..., store=..., request_log=...)`` wires the building blocks:

- text in: the body is read up to ``config.max_body_bytes`` (past it: 413, unparsed) and parsed
  as JSON (nesting too deep for the parser: 400); :mod:`router.http.openai_types`'s pydantic
  models validate it (their schemas are ``/docs``'); the tokenizer encodes prompts or renders
  the chat template; prompt + ``max_tokens`` is checked against the model's context.
- placement: :class:`router.placement.orchestrator.Orchestrator` in ``config.mode`` (disaggregated,
  colocated or auto, with failover) streams each choice's token ids; :mod:`router.http.choices`
  turns them into text. What placement and the workers raise becomes an HTTP status and an
  OpenAI error body in :func:`router.http.errors.openai_error`, nowhere else.
- text out: :mod:`router.http.openai_responses` builds bodies and SSE chunks.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with ``stream``),
``GET /v1/models``, ``POST /tokenize`` and ``POST /detokenize`` (vLLM's, with the router's
tokenizer; ``vllm bench serve`` checks its prompts' lengths with them), ``GET /health`` (each
dependency: etcd, the store, the workers by role; ``degraded`` when one is down; 503 only while
no worker can decode), ``GET /metrics``, ``GET /admin/scaling`` (the per-pool scaling signals
and desired counts as JSON, ``router.scaling.service``; it needs the cluster secret as
``Authorization: Bearer``, or, in a cluster without one, what every other path needs). Every
error, routing's 404 and 405 included, is an OpenAI error body with its status. With
``config.api_key`` set, everything but ``/health`` and ``/metrics`` needs
``Authorization: Bearer <key>`` (both checks: ``kvstore.http_auth.BearerGate``, the worker's
too; a 401 is an OpenAI error body). Admission control: past ``config.max_inflight_requests``
requests in flight, new ones get 429. A client that disconnects mid-stream closes the choice
streams, which aborts the request on its workers.

The pool's lifecycle follows the app's (started in the lifespan, on the serving loop).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.api.generate import WorkerInfo
from engine.api.tokenizer import ChatTemplateError, Tokenizer
from kvstore.http_auth import BearerGate, Gate
from router.config import RouterConfig
from router.http.bodies import body_schema, document_bodies, read_json_body
from router.http.choices import ChoiceDelta, run_choice
from router.http.errors import (
    BadRequest,
    HTTPStatus,
    ModelNotFound,
    OpenAIError,
    ServiceUnavailable,
    TooManyRequests,
    Unauthorized,
    openai_error,
)
from router.http.openai_responses import ResponseFormatter, ResponseKind
from router.http.openai_types import (
    ChatBody,
    ChatRequest,
    CompletionBody,
    CompletionRequest,
    DetokenizeBody,
    RequestOptions,
    TokenizeBody,
)
from router.http.respond import respond, stream
from router.http.state import AppState
from router.metrics import CONTENT_TYPE_LATEST, RouterMetrics
from router.placement.errors import PlacementError
from router.placement.orchestrator import Orchestrator, StorePrefixFn
from router.placement.prefill import PrefillPolicy
from router.placement.request_log import RequestLog
from router.placement.serving import ServeRequest
from router.scaling.service import ScalingService
from router.workers.client import WorkerError
from router.workers.pool import WorkerPool
from router.workers.store import StoreView

__all__ = ["AppState", "create_app"]



def create_app(
    config: RouterConfig,
    *,
    pool: WorkerPool | None = None,
    tokenizer: Tokenizer | None = None,
    metrics: RouterMetrics | None = None,
    store: StoreView | None = None,
    store_prefix: StorePrefixFn | None = None,
    request_log: RequestLog | None = None,
) -> FastAPI:
    """The app; ``pool`` defaults to one watching ``config.etcd`` (required then), its worker
    calls carrying ``config.cluster_secret``. ``store`` (the router's view of the KV store:
    lookups, probes, health; probed while the app runs) lets placement count store hits and
    avoid the store while it is down; ``store_prefix`` alone gives lookups without health.
    ``request_log`` receives one record per choice (default: the ``kvrouter.requests`` logger)."""
    if pool is None:
        if config.etcd is None:
            raise ValueError("RouterConfig.etcd is required when no WorkerPool is given")
        from kvstore.secret import bearer_headers

        pool = WorkerPool.from_etcd(config.etcd, config.cluster, rates=config.rates,
                                    client_timeout=config.worker_timeout_s,
                                    headers=bearer_headers(config.cluster_secret))
    metrics = metrics or RouterMetrics()
    policy = PrefillPolicy(config.policy, pool.index)
    orchestrator = Orchestrator(pool, policy, metrics, mode=config.mode,
                                auto_threshold=config.auto_threshold_tokens, balance=config.balance,
                                store_prefix=store.prefix_len if store is not None else store_prefix,
                                store_up=(lambda: store.up) if store is not None else None,
                                request_log=request_log)
    state = AppState(config, tokenizer or Tokenizer.from_dir(config.model_dir), pool, policy,
                     metrics, orchestrator, store)
    scaling = ScalingService(pool, metrics, config.scaling, config.mode)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await state.pool.start()
        scaler = asyncio.create_task(scaling.run(), name="scaling")
        try:
            if state.store is not None:
                await state.store.start()
            yield
        finally:
            scaler.cancel()
            await asyncio.gather(scaler, return_exceptions=True)
            if state.store is not None:
                await state.store.stop()
            await state.pool.close()

    app = FastAPI(title="kvrouter", lifespan=lifespan)
    app.state.router = state
    document_bodies(app)

    async def _error(_req: Request, exc: Exception) -> JSONResponse:
        err = openai_error(exc)
        if err is None:  # only the types registered below get here
            raise exc
        return JSONResponse(err.to_json(), status_code=err.status)

    async def _http_error(_req: Request, exc: Exception) -> JSONResponse:
        # Routing's own answers (404 unknown route, 405 method not allowed), OpenAI-shaped.
        assert isinstance(exc, StarletteHTTPException)
        err = HTTPStatus(exc.status_code, _http_message(exc))
        return JSONResponse(err.to_json(), status_code=err.status, headers=exc.headers)

    async def _validation_error(_req: Request, exc: Exception) -> JSONResponse:
        err = BadRequest(f"the request is malformed: {exc}")
        return JSONResponse(err.to_json(), status_code=err.status)

    async def _bug(_req: Request, exc: Exception) -> JSONResponse:
        # A bug: still OpenAI's shape (uvicorn logs the traceback).
        err = OpenAIError(f"internal error: {type(exc).__name__}")
        return JSONResponse(err.to_json(), status_code=err.status)

    for error_type in (OpenAIError, PlacementError, WorkerError):
        app.add_exception_handler(error_type, _error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(Exception, _bug)

    app.add_middleware(BearerGate, gates=[
        Gate(ADMIN_PREFIX, (config.cluster_secret,), lambda _reason: Unauthorized(
            "the admin API needs 'Authorization: Bearer <cluster secret>'").to_json()),
        Gate("/", (config.api_key,), lambda _reason: Unauthorized().to_json()),
    ])

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        data = [{"id": name, "object": "model", "created": 0, "owned_by": "kvcache-store",
                 "max_model_len": info.max_model_len}
                for name, info in _served_models(state).items()]
        return {"object": "list", "data": data}

    @app.get("/health")
    async def health() -> JSONResponse:
        body = _health(state)
        return JSONResponse(body, status_code=503 if body["status"] == "no workers" else 200)

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        for role in ("prefill", "decode", "colocated"):
            state.metrics.workers.labels(role).set(
                sum(1 for w in state.pool.workers() if w.info.role == role))
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get(ADMIN_PREFIX + "scaling")
    async def admin_scaling() -> JSONResponse:
        return JSONResponse(scaling.report())

    @app.post("/v1/completions", openapi_extra=body_schema(CompletionBody))
    async def completions(request: Request) -> Response:
        req = CompletionRequest.parse(await read_json_body(request, config.max_body_bytes))
        model, info = _resolve_model(state, req.options.model)
        prompts = [list(p) if isinstance(p, tuple) else state.tokenizer.encode(p) for p in req.prompts]
        vocab = state.tokenizer.vocab_size
        if any(t >= vocab for p in prompts for t in p):
            raise BadRequest(f"'prompt' holds token ids outside the vocabulary (0..{vocab - 1})",
                             param="prompt")
        return await _serve(state, request, "completion", model, info, prompts, req.options)

    @app.post("/v1/chat/completions", openapi_extra=body_schema(ChatBody))
    async def chat(request: Request) -> Response:
        req = ChatRequest.parse(await read_json_body(request, config.max_body_bytes))
        model, info = _resolve_model(state, req.options.model)
        try:
            ids = state.tokenizer.encode_chat(list(req.messages), req.add_generation_prompt,
                                              **req.template_kwargs)
        except ChatTemplateError as exc:
            raise BadRequest(str(exc), param="messages") from exc
        return await _serve(state, request, "chat", model, info, [ids], req.options)

    @app.post("/tokenize", openapi_extra=body_schema(TokenizeBody))
    async def tokenize(request: Request) -> JSONResponse:
        req = TokenizeBody.parse(await read_json_body(request, config.max_body_bytes))
        _, info = _resolve_model(state, req.model or _any_model(state))
        tok = state.tokenizer
        if req.messages is not None:
            try:
                text = tok.apply_chat_template([m.for_template() for m in req.messages],
                                               req.add_generation_prompt, **req.chat_template_kwargs)
            except ChatTemplateError as exc:
                raise BadRequest(str(exc), param="messages") from exc
            ids = tok.encode(text, add_special_tokens=bool(req.add_special_tokens))
        else:
            assert req.prompt is not None
            ids = tok.encode(req.prompt, add_special_tokens=req.add_special_tokens is not False)
        body: dict[str, Any] = {"count": len(ids), "max_model_len": info.max_model_len,
                                "tokens": ids}
        if req.return_token_strs:
            body["token_strs"] = [tok.id_to_token(t) for t in ids]
        return JSONResponse(body)

    @app.post("/detokenize", openapi_extra=body_schema(DetokenizeBody))
    async def detokenize(request: Request) -> JSONResponse:
        req = DetokenizeBody.parse(await read_json_body(request, config.max_body_bytes))
        _resolve_model(state, req.model or _any_model(state))
        vocab = state.tokenizer.vocab_size
        if any(t >= vocab for t in req.tokens):
            raise BadRequest(f"'tokens' holds token ids outside the vocabulary (0..{vocab - 1})",
                             param="tokens")
        return JSONResponse({"prompt": state.tokenizer.decode(req.tokens, skip_special_tokens=False)})

    return app


# --- helpers -------------------------------------------------------------------------------


ADMIN_PREFIX = "/admin/"
"""Paths for the cluster's own processes (the autoscaler): the cluster secret, not the API key."""


def _http_message(exc: StarletteHTTPException) -> str:
    if exc.status_code == 404:
        return "no such route; this server serves /v1/completions, /v1/chat/completions, " \
               "/v1/models, /tokenize, /detokenize, /health and /metrics"
    if exc.status_code == 405:
        return f"method not allowed here (allowed: {(exc.headers or {}).get('allow', '?')})"
    return str(exc.detail)


def _health(state: AppState) -> dict[str, Any]:
    """``/health``: every dependency's state. ``status``: ``ok``; ``degraded`` when etcd, the
    store or a role the mode needs is down but requests are still served (answered 200, so a
    load balancer keeps this router: it serves what it can, and another router of the same
    cluster would fare no better); ``no workers`` when no worker can decode (503)."""
    pool, mode = state.pool, state.config.mode
    prefill, decode = len(pool.prefill_workers()), len(pool.decode_workers())
    body = pool.health()
    roles: dict[str, int] = body["roles"]
    needs_prefill = mode == "disaggregated"
    workers_ok = decode > 0 and (prefill > 0 or not needs_prefill)
    worker_detail = ("ok" if workers_ok else "no decode-capable worker" if decode == 0
                     else "no prefill worker (requests need one in disaggregated mode)")
    store = state.store.health() if state.store is not None else {"status": "not configured"}
    deps = {
        "etcd": {"status": "ok" if pool.etcd_healthy else "down", "detail": body["membership"]},
        "store": store,
        "workers": {"status": "ok" if workers_ok else "down", "detail": worker_detail,
                    "prefill": roles.get("prefill", 0), "decode": roles.get("decode", 0),
                    "colocated": roles.get("colocated", 0), "prefill_capable": prefill,
                    "decode_capable": decode},
    }
    down = [name for name, d in deps.items() if d["status"] == "down"]
    body["status"] = "no workers" if decode == 0 else "degraded" if down else "ok"
    body["down"] = down
    body["dependencies"] = deps
    body["in_flight"] = state.in_flight
    return body


def _served_models(state: AppState) -> dict[str, WorkerInfo]:
    models = state.pool.models()
    alias = state.config.served_model_name
    if alias and models:
        return {alias: next(iter(models.values()))}
    return models


def _any_model(state: AppState) -> str:
    """The model a request that names none is about (``/tokenize``: vLLM's ``model`` is optional)."""
    served = _served_models(state)
    if not served:
        raise ServiceUnavailable("no worker is registered yet; retry shortly")
    return next(iter(served))


def _resolve_model(state: AppState, name: str) -> tuple[str, WorkerInfo]:
    """(the workers' model name, one worker's info) for the client's ``model``."""
    models = state.pool.models()
    if name in models:
        return name, models[name]
    alias = state.config.served_model_name
    if alias and name == alias:
        if not models:
            raise ServiceUnavailable("no worker is registered yet; retry shortly")
        worker_model = next(iter(models))
        return worker_model, models[worker_model]
    if not models and not alias:
        raise ServiceUnavailable("no worker is registered yet; retry shortly")
    raise ModelNotFound(name, sorted(_served_models(state)))


def _check_lengths(prompt: list[int], options: RequestOptions, max_model_len: int) -> int:
    """The request's max_tokens, after checking it and the prompt fit the context (and that
    ``min_tokens`` fits in it)."""
    if not prompt:
        raise BadRequest("the prompt encodes to no tokens", param="prompt")
    if len(prompt) >= max_model_len:
        raise BadRequest(f"the prompt has {len(prompt)} tokens; this model's context is "
                         f"{max_model_len} tokens", param="prompt", code="context_length_exceeded")
    room = max_model_len - len(prompt)
    if options.max_tokens is None:
        if options.min_tokens > room:
            raise BadRequest(f"min_tokens={options.min_tokens} plus the prompt's {len(prompt)} "
                             f"tokens exceeds the context of {max_model_len} tokens",
                             param="min_tokens", code="context_length_exceeded")
        return room
    if options.max_tokens > room:
        raise BadRequest(f"max_tokens={options.max_tokens} plus the prompt's {len(prompt)} tokens "
                         f"exceeds the context of {max_model_len} tokens; use at most {room}",
                         param="max_tokens", code="context_length_exceeded")
    return options.max_tokens


async def _serve(state: AppState, http: Request, kind: ResponseKind, model: str, info: WorkerInfo,
                 prompts: list[list[int]], options: RequestOptions) -> Response:
    max_tokens = [_check_lengths(p, options, info.max_model_len) for p in prompts]
    vocab = state.tokenizer.vocab_size
    if options.logit_bias and max(options.logit_bias) >= vocab:
        raise BadRequest(f"'logit_bias' names token ids outside the vocabulary (0..{vocab - 1})",
                         param="logit_bias")
    if state.in_flight >= state.config.max_inflight_requests:
        state.metrics.requests.labels(kind, "429").inc()
        raise TooManyRequests(f"the router is serving {state.in_flight} requests, its limit; "
                              "retry with backoff")
    fmt = ResponseFormatter(kind, options.model, state.tokenizer)
    arrival = time.monotonic()
    serves: list[AsyncGenerator[ChoiceDelta, None]] = []
    for i, prompt in enumerate(prompts):
        state.metrics.prompt_tokens.inc(len(prompt))
        for j in range(options.n):
            index = i * options.n + j
            sreq = ServeRequest(f"{fmt.id}-{index}", model, prompt,
                                options.sampling(max_tokens[i], j), options.cache_salt)
            serves.append(run_choice(state.orchestrator, state.tokenizer, state.metrics,
                                     sreq, options, index, arrival))
    if options.stream:
        choice_prompt_tokens = [len(p) for p in prompts for _ in range(options.n)]
        return StreamingResponse(stream(state, fmt, kind, serves, options, choice_prompt_tokens),
                                 media_type="text/event-stream")
    return await respond(state, http, fmt, kind, serves, options, sum(len(p) for p in prompts))
