"""The router's OpenAI-compatible HTTP app (FastAPI).

``create_app(config, pool=..., store_prefix=..., request_log=...)`` wires the building blocks:

- text in: :mod:`router.http.openai_types` parses and validates; the tokenizer encodes prompts or
  renders the chat template; prompt + ``max_tokens`` is checked against the model's context.
- placement: :class:`router.placement.orchestrator.Orchestrator` in ``config.mode`` (disaggregated,
  colocated or auto, with failover) streams each choice's token ids; :mod:`router.http.choices`
  turns them into text. What placement and the workers raise becomes an HTTP status and an
  OpenAI error body in :func:`router.http.errors.openai_error`, nowhere else.
- text out: :mod:`router.http.openai_responses` builds bodies and SSE chunks.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with ``stream``),
``GET /v1/models``, ``GET /health`` (503 while no worker is known; says when etcd is
unreachable), ``GET /metrics``. With ``config.api_key`` set, ``/v1/*`` needs
``Authorization: Bearer <key>``. Admission control: past ``config.max_inflight_requests``
requests in flight, new ones get 429. A client that disconnects mid-stream closes the choice
streams, which aborts the request on its workers.

The pool's lifecycle follows the app's (started in the lifespan, on the serving loop).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from engine.api.generate import RequestStats, WorkerInfo
from engine.api.tokenizer import ChatTemplateError, Tokenizer
from router.config import RouterConfig
from router.http.choices import ChoiceDelta, ChoiceResult, collect_choice, run_choice
from router.http.errors import (BadRequest, ModelNotFound, OpenAIError, ServiceUnavailable,
                                TooManyRequests, Unauthorized, openai_error)
from router.http.openai_responses import SSE_DONE, ResponseFormatter, ResponseKind, sse, usage_json
from router.http.openai_types import ChatRequest, CompletionRequest, RequestOptions
from router.metrics import CONTENT_TYPE_LATEST, RouterMetrics
from router.placement.errors import PlacementError
from router.placement.orchestrator import Orchestrator, StorePrefixFn
from router.placement.prefill import PrefillPolicy
from router.placement.serving import ServeRequest, Serving
from router.request_log import RequestLog
from router.workers.client import WorkerError
from router.workers.pool import WorkerPool

__all__ = ["AppState", "create_app"]

T = TypeVar("T")


@dataclass(eq=False)
class AppState:
    """Everything a request handler needs."""

    config: RouterConfig
    tokenizer: Tokenizer
    pool: WorkerPool
    policy: PrefillPolicy
    metrics: RouterMetrics
    orchestrator: Serving
    in_flight: int = 0


def create_app(
    config: RouterConfig,
    *,
    pool: WorkerPool | None = None,
    tokenizer: Tokenizer | None = None,
    metrics: RouterMetrics | None = None,
    store_prefix: StorePrefixFn | None = None,
    request_log: RequestLog | None = None,
) -> FastAPI:
    """The app; ``pool`` defaults to one watching ``config.etcd`` (required then).
    ``store_prefix`` (a store client's ``prefix_len``) lets placement count store hits;
    ``request_log`` receives one record per choice (default: the ``kvrouter.requests`` logger)."""
    if pool is None:
        if config.etcd is None:
            raise ValueError("RouterConfig.etcd is required when no WorkerPool is given")
        pool = WorkerPool.from_etcd(config.etcd, config.cluster, rates=config.rates,
                                    client_timeout=config.worker_timeout_s)
    metrics = metrics or RouterMetrics()
    policy = PrefillPolicy(config.policy, pool.index)
    orchestrator = Orchestrator(pool, policy, metrics, mode=config.mode,
                                auto_threshold=config.auto_threshold_tokens,
                                store_prefix=store_prefix, request_log=request_log)
    state = AppState(config, tokenizer or Tokenizer.from_dir(config.model_dir), pool, policy,
                     metrics, orchestrator)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await state.pool.start()
        try:
            yield
        finally:
            await state.pool.close()

    app = FastAPI(title="kvrouter", lifespan=lifespan)
    app.state.router = state

    async def _error(_req: Request, exc: Exception) -> JSONResponse:
        err = openai_error(exc)
        if err is None:  # only the types registered below get here
            raise exc
        return JSONResponse(err.to_json(), status_code=err.status)

    for error_type in (OpenAIError, PlacementError, WorkerError):
        app.add_exception_handler(error_type, _error)

    @app.middleware("http")
    async def _auth(request: Request, call_next: Any) -> Response:
        if config.api_key and request.url.path.startswith("/v1/"):
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {config.api_key}".encode()):
                err = Unauthorized()
                return JSONResponse(err.to_json(), status_code=err.status)
        return await call_next(request)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        data = [{"id": name, "object": "model", "created": 0, "owned_by": "kvcache-store",
                 "max_model_len": info.max_model_len}
                for name, info in _served_models(state).items()]
        return {"object": "list", "data": data}

    @app.get("/health")
    async def health() -> JSONResponse:
        body = state.pool.health()
        ok = body["workers"] > 0
        body["status"] = ("ok" if state.pool.etcd_healthy else "degraded") if ok else "no workers"
        body["in_flight"] = state.in_flight
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        for role in ("prefill", "decode", "colocated"):
            state.metrics.workers.labels(role).set(
                sum(1 for w in state.pool.workers() if w.info.role == role))
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = CompletionRequest.parse(await _json_body(request))
        model, info = _resolve_model(state, req.options.model)
        prompts = [list(p) if isinstance(p, tuple) else state.tokenizer.encode(p) for p in req.prompts]
        vocab = state.tokenizer.vocab_size
        if any(t >= vocab for p in prompts for t in p):
            raise BadRequest(f"'prompt' holds token ids outside the vocabulary (0..{vocab - 1})",
                             param="prompt")
        return await _serve(state, request, "completion", model, info, prompts, req.options)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        req = ChatRequest.parse(await _json_body(request))
        model, info = _resolve_model(state, req.options.model)
        try:
            ids = state.tokenizer.encode_chat(list(req.messages), req.add_generation_prompt,
                                              **req.template_kwargs)
        except ChatTemplateError as exc:
            raise BadRequest(str(exc), param="messages") from exc
        return await _serve(state, request, "chat", model, info, [ids], req.options)

    return app


# --- helpers -------------------------------------------------------------------------------


async def _json_body(request: Request) -> Any:
    try:
        return json.loads(await request.body())
    except ValueError as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}") from exc


def _served_models(state: AppState) -> dict[str, WorkerInfo]:
    models = state.pool.models()
    alias = state.config.served_model_name
    if alias and models:
        return {alias: next(iter(models.values()))}
    return models


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
    """The request's max_tokens, after checking it and the prompt fit the context."""
    if not prompt:
        raise BadRequest("the prompt encodes to no tokens", param="prompt")
    if len(prompt) >= max_model_len:
        raise BadRequest(f"the prompt has {len(prompt)} tokens; this model's context is "
                         f"{max_model_len} tokens", param="prompt", code="context_length_exceeded")
    room = max_model_len - len(prompt)
    if options.max_tokens is None:
        return room
    if options.max_tokens > room:
        raise BadRequest(f"max_tokens={options.max_tokens} plus the prompt's {len(prompt)} tokens "
                         f"exceeds the context of {max_model_len} tokens; use at most {room}",
                         param="max_tokens", code="context_length_exceeded")
    return options.max_tokens


async def _serve(state: AppState, http: Request, kind: ResponseKind, model: str, info: WorkerInfo,
                 prompts: list[list[int]], options: RequestOptions) -> Response:
    max_tokens = [_check_lengths(p, options, info.max_model_len) for p in prompts]
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
    prompt_tokens = sum(len(p) for p in prompts)
    if options.stream:
        return StreamingResponse(_stream(state, fmt, kind, serves, options, prompt_tokens),
                                 media_type="text/event-stream")
    return await _respond(state, http, fmt, kind, serves, options, prompt_tokens)


async def _respond(state: AppState, http: Request, fmt: ResponseFormatter, kind: str,
                   serves: list[AsyncGenerator[ChoiceDelta, None]], options: RequestOptions,
                   prompt_tokens: int) -> Response:
    """The non-streaming body: every choice collected. A client that disconnects first
    cancels the collection, which closes the choice streams and so aborts the request on
    its workers (as a streaming client's disconnect does)."""
    state.in_flight += 1
    state.metrics.in_flight.inc()
    tasks = [asyncio.create_task(collect_choice(s, i, options.logprobs is not None))
             for i, s in enumerate(serves)]
    status = "200"
    try:
        results = await _unless_disconnected(http, asyncio.gather(*tasks))
    except _ClientGone:
        status = "499"
        return Response(status_code=499)
    except Exception as exc:  # answered by the app's handlers (router.http.errors)
        err = openai_error(exc)
        status = str(err.status) if err is not None else "500"
        raise
    finally:
        state.in_flight -= 1
        state.metrics.in_flight.dec()
        state.metrics.requests.labels(kind, status).inc()
        for t in tasks:  # one choice failed (or the client left): stop the others
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    stats = {r.index: r.stats for r in results if r.stats is not None}
    usage = usage_json(prompt_tokens, sum(len(r.token_ids) for r in results),
                       _cached_tokens(stats, options.n))
    return JSONResponse(fmt.response([_choice_json(fmt, r, options) for r in results], usage))


class _ClientGone(Exception):
    """The HTTP client disconnected before its response was ready."""


async def _unless_disconnected(http: Request, work: Awaitable[T]) -> T:
    """``work``'s result, unless the client disconnects first: then ``work`` is cancelled and
    :class:`_ClientGone` raised. The body has been read, so the next ASGI message the server
    can deliver is the disconnect: one waiting ``receive``, no polling."""
    job = asyncio.ensure_future(work)

    async def client_gone() -> None:
        while (await http.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.create_task(client_gone())
    try:
        await asyncio.wait((job, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not job.done():
            job.cancel()
    if job.done() and not job.cancelled():
        return job.result()
    raise _ClientGone()


def _choice_json(fmt: ResponseFormatter, r: ChoiceResult, options: RequestOptions) -> dict[str, Any]:
    logprobs = fmt.logprobs(r.token_ids, r.logprobs) if r.logprobs is not None else None
    return fmt.choice(r.index, r.text, r.finish_reason, logprobs)


def _cached_tokens(stats: dict[int, RequestStats], n: int) -> int:
    """``usage.prompt_tokens_details.cached_tokens`` (OpenAI's and vLLM's meaning): prompt
    tokens found cached, in a worker's device cache or in the store, from each choice's
    final stats. Counted once per prompt, as ``prompt_tokens`` is: the ``n`` choices of a
    prompt (indexes ``i * n + j``) share it, and the most any of them found is its figure."""
    per_prompt: dict[int, int] = {}
    for index, st in stats.items():
        hit = st.device_hit_tokens + st.store_hit_tokens
        per_prompt[index // n] = max(per_prompt.get(index // n, 0), hit)
    return sum(per_prompt.values())


async def _stream(state: AppState, fmt: ResponseFormatter, kind: str,
                  serves: list[AsyncGenerator[ChoiceDelta, None]], options: RequestOptions,
                  prompt_tokens: int) -> AsyncIterator[bytes]:
    """SSE body: every choice's deltas as they come, usage if asked, ``[DONE]``."""
    queue: asyncio.Queue[ChoiceDelta | BaseException | None] = asyncio.Queue()

    async def pump(deltas: AsyncGenerator[ChoiceDelta, None]) -> None:
        try:
            async with aclosing(deltas) as stream:
                async for d in stream:
                    await queue.put(d)
        except Exception as exc:  # reported in the stream, below
            await queue.put(exc)
        finally:
            await queue.put(None)

    status = "200"
    completion_tokens = 0
    stats: dict[int, RequestStats] = {}
    state.in_flight += 1
    state.metrics.in_flight.inc()
    tasks = [asyncio.create_task(pump(s)) for s in serves]
    try:
        if kind == "chat":
            for i in range(len(serves)):
                yield sse(fmt.role_chunk(i))
        open_choices = len(tasks)
        while open_choices:
            item = await queue.get()
            if item is None:
                open_choices -= 1
            elif isinstance(item, BaseException):
                err = openai_error(item) or ServiceUnavailable(str(item))
                status = str(err.status)
                yield sse(err.to_json())
                break
            else:
                completion_tokens += len(item.token_ids)
                if item.stats is not None:
                    stats[item.index] = item.stats
                if item.text or item.finish_reason is not None or item.logprobs:
                    lps = (fmt.logprobs(item.token_ids, item.logprobs, item.text_offset)
                           if item.logprobs else None)
                    yield sse(fmt.chunk(item.index, item.text, item.finish_reason, lps))
        if options.include_usage and status == "200":
            usage = usage_json(prompt_tokens, completion_tokens, _cached_tokens(stats, options.n))
            yield sse(fmt.usage_chunk(usage))
        yield SSE_DONE
    except asyncio.CancelledError:
        status = "499"  # the client went away
        raise
    finally:
        # Book-keeping first: in a cancelled scope the await below may itself be cancelled.
        state.in_flight -= 1
        state.metrics.in_flight.dec()
        state.metrics.requests.labels(kind, status).inc()
        for t in tasks:  # closes each choice's stream: its workers abort the request
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

