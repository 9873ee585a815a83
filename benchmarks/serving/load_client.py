"""The streaming load client: one OpenAI completion over SSE, and a whole workload on its schedule.

A request is ``POST {base_url}/v1/completions`` with the prompt as token ids, ``stream: true``,
``stream_options.include_usage``, ``ignore_eos`` (vLLM's extension, so output lengths are
exact) and ``temperature``. Timing is the client's own, from just before the request is
written: a token event is an SSE chunk whose ``choices[0].text`` is not empty (a chunk that
only carries a ``finish_reason`` is none); TTFT is the first event, ITLs the gaps between
events, E2E the end of the stream. A server may hold back a token whose text is empty (part
of a UTF-8 character) and send it with the finish: when no chunk had text, TTFT is the first
chunk with choices, the earliest the client learned of a token. Output tokens come from ``usage.completion_tokens`` when
the server reports it, else from the number of token events. A request fails on a non-200
status, an error object in the stream, a stream that ends without ``data: [DONE]``, its own
timeout, or the run's time bound.

``run_workload`` is open loop: each request is sent at its ``arrival_s`` whether or not
earlier ones have finished; a follow-up goes ``delay_s`` after the request it follows ends.
Nothing is sent after ``max_duration_s``; whatever is still in flight ``grace_s`` later is
cancelled and recorded as failed.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from tqdm import tqdm

from planner.metrics import RequestResult
from planner.workloads import BenchRequest

__all__ = ["ClientConfig", "RunOutcome", "completion_body", "stream_completion", "run_workload",
           "fetch_model", "require_loopback"]

LOOPBACK = {"127.0.0.1", "localhost", "::1"}


@dataclass(frozen=True)
class ClientConfig:
    base_url: str
    model: str
    request_timeout_s: float = 300.0
    max_duration_s: float = 120.0  # nothing is sent after this many seconds
    grace_s: float = 60.0  # in-flight requests are cancelled this long after max_duration_s
    max_concurrency: int = 0  # 0: unbounded (open loop)
    temperature: float = 0.0
    ignore_eos: bool = True
    progress: bool = True
    extra_body: dict[str, Any] = field(default_factory=dict)  # merged into every request body
    headers: dict[str, str] = field(default_factory=dict)  # sent with every request (e.g. Authorization)
    request_salt: str | None = None  # set: cache_salt = this + the request's id (no prefix reuse)

    def __post_init__(self) -> None:
        require_loopback(self.base_url)
        if self.max_duration_s <= 0 or self.grace_s < 0 or self.request_timeout_s <= 0:
            raise ValueError(f"time bounds must be positive: {self}")


def require_loopback(url: str) -> None:
    """The load generator drives local clusters only."""
    host = urlsplit(url).hostname or ""
    if host not in LOOPBACK and not host.startswith("127."):
        raise ValueError(f"{url}: the load generator only drives loopback endpoints")


def completion_body(req: BenchRequest, cfg: ClientConfig) -> dict[str, Any]:
    return {
        "model": cfg.model, "prompt": list(req.prompt), "max_tokens": req.max_tokens,
        "temperature": cfg.temperature, "ignore_eos": cfg.ignore_eos, "stream": True,
        "stream_options": {"include_usage": True}, **cfg.extra_body,
        **({"cache_salt": cfg.request_salt + req.request_id} if cfg.request_salt is not None else {}),
    }


async def stream_completion(session: aiohttp.ClientSession, cfg: ClientConfig, req: BenchRequest,
                            result: RequestResult, t0: float) -> None:
    """Send ``req`` and fill ``result`` in place (also when cancelled midway)."""
    url = cfg.base_url.rstrip("/") + "/v1/completions"
    body = completion_body(req, cfg)
    start = time.perf_counter()
    result.sent_s = start - t0
    events = 0
    last = start
    first_choice: float | None = None
    usage: dict[str, Any] | None = None
    try:
        async with session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=cfg.request_timeout_s)) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                now = time.perf_counter()
                if data == b"[DONE]":
                    result.e2e_s = now - start
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = f"stream error: {json.dumps(chunk['error'])[:300]}"
                    return
                if chunk.get("usage"):
                    usage = chunk["usage"]
                choices = chunk.get("choices") or []
                if choices and first_choice is None:
                    first_choice = now
                if choices and choices[0].get("text"):
                    if events == 0:
                        result.ttft_s = now - start
                    else:
                        result.itl_s.append(now - last)
                    events += 1
                    last = now
            else:
                result.error = "stream ended without data: [DONE]"
                return
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as e:
        result.error = f"{type(e).__name__}: {e}"[:300]
        return
    finally:
        result.output_tokens = int(usage["completion_tokens"]) if usage and "completion_tokens" in usage else events
        if usage:
            result.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    if result.ttft_s is None and first_choice is not None and result.output_tokens > 0:
        result.ttft_s = first_choice - start  # every token's text was empty
    if result.ttft_s is None:
        result.error = "no token in the stream"


@dataclass
class RunOutcome:
    results: list[RequestResult]  # one per request sent, in completion order
    duration_s: float  # start -> the last request finished
    not_sent: int  # requests past the time bound, or follow-ups of those


async def run_workload(requests: Sequence[BenchRequest], cfg: ClientConfig, desc: str = "serve_bench") -> RunOutcome:
    """Send ``requests`` on their schedule (see the module docstring) and collect results."""
    followers: dict[str, list[BenchRequest]] = defaultdict(list)
    for r in requests:
        if r.after is not None:
            followers[r.after].append(r)
    results: list[RequestResult] = []
    tasks: set[asyncio.Task] = set()
    sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency > 0 else None
    bar = tqdm(total=len(requests), desc=desc, unit="req", disable=not cfg.progress, leave=False)
    t0 = time.perf_counter()

    def now() -> float:
        return time.perf_counter() - t0

    async def one(session: aiohttp.ClientSession, req: BenchRequest, at: float) -> None:
        await asyncio.sleep(max(0.0, at - now()))
        if at > cfg.max_duration_s:
            return
        result = RequestResult(req.request_id, req.tag, len(req.prompt), req.max_tokens, scheduled_s=at)
        try:
            if sem is None:
                await stream_completion(session, cfg, req, result, t0)
            else:
                async with sem:
                    await stream_completion(session, cfg, req, result, t0)
        except asyncio.CancelledError:
            result.error = result.error or "cancelled at the run's time bound"
            results.append(result)
            return
        results.append(result)
        bar.update(1)
        for f in followers.get(req.request_id, ()):
            spawn(session, f, now() + f.delay_s)

    def spawn(session: aiohttp.ClientSession, req: BenchRequest, at: float) -> None:
        tasks.add(asyncio.create_task(one(session, req, at)))

    hard_deadline = cfg.max_duration_s + cfg.grace_s
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), headers=cfg.headers) as session:
        for r in requests:
            if r.after is None:
                spawn(session, r, r.arrival_s)
        while tasks:
            done, _ = await asyncio.wait(tasks, timeout=max(0.0, hard_deadline - now()),
                                         return_when=asyncio.FIRST_COMPLETED)
            tasks.difference_update(done)
            for t in done:
                t.result()  # a bug in the client surfaces here, not as a silent loss
            if tasks and now() >= hard_deadline:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                tasks.clear()
    bar.close()
    return RunOutcome(results, now(), len(requests) - len(results))


async def fetch_model(base_url: str, timeout_s: float = 10.0, headers: dict[str, str] | None = None) -> str:
    """The first model id that ``GET /v1/models`` lists."""
    async with aiohttp.ClientSession(headers=headers) as session:
        async with session.get(base_url.rstrip("/") + "/v1/models",
                               timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            resp.raise_for_status()
            return (await resp.json())["data"][0]["id"]
