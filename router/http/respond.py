"""How a served request's choices go back to the client: one JSON body (``respond``) or an SSE
stream (``stream``), each keeping the router's in-flight count and request metrics, and each
closing every choice's stream (so its workers abort it) when the client leaves or a choice
fails."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from contextlib import aclosing
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from engine.api.generate import RequestStats
from router.http.choices import ChoiceDelta, ChoiceResult, collect_choice
from router.http.errors import ServiceUnavailable, openai_error
from router.http.openai_responses import SSE_DONE, ResponseFormatter, sse, usage_json
from router.http.openai_types import RequestOptions
from router.http.state import AppState

__all__ = ["respond", "stream", "ClientGone"]

T = TypeVar("T")


async def respond(state: AppState, http: Request, fmt: ResponseFormatter, kind: str,
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
    except ClientGone:
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


class ClientGone(Exception):
    """The HTTP client disconnected before its response was ready."""


async def _unless_disconnected(http: Request, work: Awaitable[T]) -> T:
    """``work``'s result, unless the client disconnects first: then ``work`` is cancelled and
    :class:`ClientGone` raised. The body has been read, so the next ASGI message the server
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
    raise ClientGone()


def _choice_json(fmt: ResponseFormatter, r: ChoiceResult, options: RequestOptions) -> dict[str, Any]:
    logprobs = fmt.logprobs(r.token_ids, r.logprobs) if r.logprobs is not None else None
    return fmt.choice(r.index, r.text, r.finish_reason, logprobs,
                      r.token_ids if options.return_token_ids else None)


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


async def stream(state: AppState, fmt: ResponseFormatter, kind: str,
                  serves: list[AsyncGenerator[ChoiceDelta, None]], options: RequestOptions,
                  choice_prompt_tokens: list[int]) -> AsyncIterator[bytes]:
    """SSE body: every choice's deltas as they come, usage if asked, ``[DONE]``.

    ``choice_prompt_tokens[i]``: the length of choice ``i``'s prompt. With
    ``options.continuous_usage`` (vLLM's ``continuous_usage_stats``) every chunk of choice
    ``i`` carries ``usage``: its prompt's tokens and the tokens choice ``i`` generated so far
    (a chat's role chunk: 0), as vLLM's chunks do; the last chunk's usage covers them all."""
    prompt_tokens = sum(choice_prompt_tokens[::options.n])  # each prompt once
    generated = [0] * len(serves)

    def with_usage(chunk: dict[str, Any], index: int) -> dict[str, Any]:
        if options.continuous_usage:
            chunk["usage"] = usage_json(choice_prompt_tokens[index], generated[index])
        return chunk

    queue: asyncio.Queue[ChoiceDelta | BaseException | None] = asyncio.Queue()

    async def pump(deltas: AsyncGenerator[ChoiceDelta, None]) -> None:
        try:
            async with aclosing(deltas) as stream:
                async for d in stream:
                    await queue.put(d)
        except Exception as exc:  # noqa: BLE001 - reported in the stream, below
            await queue.put(exc)
        finally:
            await queue.put(None)

    status = "200"
    stats: dict[int, RequestStats] = {}
    state.in_flight += 1
    state.metrics.in_flight.inc()
    tasks = [asyncio.create_task(pump(s)) for s in serves]
    try:
        if kind == "chat":
            for i in range(len(serves)):
                yield sse(with_usage(fmt.role_chunk(i), i))
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
                generated[item.index] += len(item.token_ids)
                if item.stats is not None:
                    stats[item.index] = item.stats
                if (item.text or item.finish_reason is not None or item.logprobs
                        or (options.return_token_ids and item.token_ids)):
                    lps = (fmt.logprobs(item.token_ids, item.logprobs, item.text_offset)
                           if item.logprobs else None)
                    ids = item.token_ids if options.return_token_ids else None
                    yield sse(with_usage(fmt.chunk(item.index, item.text, item.finish_reason, lps, ids),
                                         item.index))
        if options.include_usage and status == "200":
            usage = usage_json(prompt_tokens, sum(generated), _cached_tokens(stats, options.n))
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

