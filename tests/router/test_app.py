"""The OpenAI-compatible app end to end over HTTP (uvicorn), with the orchestrator in colocated
mode and a fake worker; the official openai client talks to it unchanged."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn

from engine.api.generate import RequestStats
from kvstore.proc import free_port
from router.config import RouterConfig
from router.http.app import create_app
from router.workers.pool import StaticMembership, WorkerPool
from tests.router.fake_worker import FakeWorker

ANSWER = " Paris is the capital of France."


async def _until(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


@asynccontextmanager
async def _router(tokenizer_dir: Path, workers: list[FakeWorker], *, pool: WorkerPool | None = None,
                  store=None, request_log=None, **cfg) -> AsyncIterator[str]:
    config = RouterConfig(model_dir=str(tokenizer_dir), **{"mode": "colocated", **cfg})
    pool = pool or WorkerPool(StaticMembership([w.info for w in workers]))
    app = create_app(config, pool=pool, store=store, request_log=request_log)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           lifespan="on"))
    task = asyncio.create_task(server.serve())
    try:
        await _until(lambda: server.started)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task


def _run(fn: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(fn(), 60))


async def _fake(tokenizer) -> FakeWorker:
    fake = await FakeWorker().start()
    fake.script = tokenizer.encode(ANSWER, add_special_tokens=False)
    return fake


def test_openai_client_completions_chat_and_streaming(tokenizer_dir: Path, tokenizer) -> None:
    async def body() -> None:
        fake = await _fake(tokenizer)
        async with _router(tokenizer_dir, [fake]) as url:
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
            models = await client.models.list()
            assert [m.id for m in models.data] == ["tiny"]
            out = await client.completions.create(model="tiny", prompt="What is the capital of France?",
                                                  max_tokens=50, temperature=0)
            assert out.choices[0].text == ANSWER and out.choices[0].finish_reason == "stop"
            prompt_ids = tokenizer.encode("What is the capital of France?")
            assert out.usage.prompt_tokens == len(prompt_ids)
            assert out.usage.completion_tokens == len(fake.script)
            assert fake.requests[-1].prompt_token_ids == prompt_ids
            assert fake.requests[-1].phase == "full" and fake.requests[-1].sampling.temperature == 0.0

            messages = [{"role": "user", "content": "What is the capital of France?"}]
            chat = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=5)
            assert chat.choices[0].message.content == tokenizer.decode(fake.script[:5])
            assert chat.choices[0].finish_reason == "length"
            assert fake.requests[-1].prompt_token_ids == tokenizer.encode_chat(messages)

            stream = await client.chat.completions.create(
                model="tiny", messages=messages, stream=True, stream_options={"include_usage": True})
            parts, reasons, usage = [], [], None
            async for chunk in stream:
                if chunk.usage is not None:
                    usage = chunk.usage
                for c in chunk.choices:
                    parts.append(c.delta.content or "")
                    reasons.append(c.finish_reason)
            assert "".join(parts) == ANSWER and reasons[-1] == "stop"
            assert usage is not None and usage.completion_tokens == len(fake.script)

            n2 = await client.completions.create(model="tiny", prompt="Hi", n=2, max_tokens=3, seed=7,
                                                 logprobs=1)
            assert [c.index for c in n2.choices] == [0, 1]
            assert [r.sampling.seed for r in fake.requests[-2:]] in ([7, 8], [8, 7])
            assert n2.choices[0].logprobs.token_logprobs == [-0.25] * 3
            assert "".join(n2.choices[0].logprobs.tokens) == n2.choices[0].text
        await fake.stop()

    _run(body)


def test_return_token_ids_gives_the_generated_ids_whole_and_per_chunk(tokenizer_dir: Path, tokenizer) -> None:
    """vLLM's ``return_token_ids``: ``token_ids`` in each choice, and in each streamed chunk
    the ids that chunk's text came from (together, the whole output)."""
    async def body() -> None:
        fake = await _fake(tokenizer)
        async with _router(tokenizer_dir, [fake]) as url:
            async with httpx.AsyncClient(base_url=url, timeout=30) as http:
                base = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 50, "temperature": 0}
                whole = (await http.post("/v1/completions", json={**base, "return_token_ids": True})).json()
                assert whole["choices"][0]["token_ids"] == fake.script
                plain = (await http.post("/v1/completions", json=base)).json()
                assert "token_ids" not in plain["choices"][0]
                ids, text = [], ""
                async with http.stream("POST", "/v1/completions",
                                       json={**base, "stream": True, "return_token_ids": True}) as resp:
                    async for line in resp.aiter_lines():
                        if line.startswith("data: {"):
                            for c in json.loads(line[6:])["choices"]:
                                ids += c["token_ids"]
                                text += c["text"]
                assert ids == fake.script and text == ANSWER
        await fake.stop()

    _run(body)


def test_stop_string_cuts_text_and_aborts_the_worker(tokenizer_dir: Path, tokenizer) -> None:
    async def body() -> None:
        fake = await _fake(tokenizer)
        fake.token_delay = 0.02
        async with _router(tokenizer_dir, [fake]) as url:
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
            out = await client.completions.create(model="tiny", prompt="Q", max_tokens=50, stop=["capital"])
            assert out.choices[0].text == " Paris is the " and out.choices[0].finish_reason == "stop"
            await _until(lambda: fake.aborted == [fake.requests[-1].request_id])
            # A client that goes away mid-stream: the worker is told to abort.
            async with httpx.AsyncClient(base_url=url) as http:
                async with http.stream("POST", "/v1/completions", json={
                        "model": "tiny", "prompt": "Q", "max_tokens": 50, "stream": True}) as resp:
                    async for line in resp.aiter_lines():
                        if line.startswith("data: {"):
                            break
            await _until(lambda: len(fake.aborted) == 2 and not fake.in_progress)
            assert fake.aborted[1] == fake.requests[-1].request_id
            metrics = (await httpx.AsyncClient().get(url + "/metrics")).text
            assert 'kvrouter_routing_decisions_total{phase="full",worker="w0"} 2.0' in metrics
            assert 'kvrouter_requests_total{endpoint="completion",status="499"} 1.0' in metrics
            assert "kvrouter_time_to_first_token_seconds_count 2.0" in metrics
        await fake.stop()

    _run(body)


def test_usage_reports_cached_prompt_tokens(tokenizer_dir: Path, tokenizer) -> None:
    """``usage.prompt_tokens_details.cached_tokens`` (device + store hits from the worker's
    stats), streamed or not, counted once per prompt however many choices share it."""
    async def body() -> None:
        fake = await _fake(tokenizer)
        fake.stats = RequestStats(computed_prompt_tokens=3, device_hit_tokens=4, store_hit_tokens=2)
        prompt = "What is the capital of France? " * 2
        async with _router(tokenizer_dir, [fake]) as url:
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
            out = await client.completions.create(model="tiny", prompt=prompt, max_tokens=3)
            assert out.usage.prompt_tokens_details.cached_tokens == 6
            two = await client.completions.create(model="tiny", prompt=prompt, max_tokens=3, n=2)
            assert two.usage.prompt_tokens == out.usage.prompt_tokens
            assert two.usage.prompt_tokens_details.cached_tokens == 6
            stream = await client.completions.create(
                model="tiny", prompt=[prompt, "Hello world! " * 3], max_tokens=3, n=2,
                stream=True, stream_options={"include_usage": True})
            usage = [c.usage async for c in stream if c.usage is not None]
            assert len(usage) == 1 and usage[0].prompt_tokens_details.cached_tokens == 12
        await fake.stop()

    _run(body)


def test_a_non_streaming_client_that_disconnects_aborts_the_request(tokenizer_dir: Path,
                                                                    tokenizer) -> None:
    async def body() -> None:
        fake = await _fake(tokenizer)
        fake.script = None                       # prompt[-1] + 1, ...: as long as max_tokens
        fake.token_delay = 0.05                  # 100 tokens: 5 s if nobody stops it
        async with _router(tokenizer_dir, [fake]) as url:
            async with httpx.AsyncClient(base_url=url) as http:
                with pytest.raises(httpx.ReadTimeout):
                    await http.post("/v1/completions", timeout=0.5, json={
                        "model": "tiny", "prompt": "Q", "max_tokens": 100, "ignore_eos": True})
            await _until(lambda: len(fake.aborted) == 1 and not fake.in_progress, timeout=2.0)
            assert fake.aborted == [fake.requests[-1].request_id]
            metrics = (await httpx.AsyncClient().get(url + "/metrics")).text
            assert 'kvrouter_requests_total{endpoint="completion",status="499"} 1.0' in metrics
            assert "kvrouter_requests_in_flight 0.0" in metrics
        await fake.stop()

    _run(body)


def test_error_statuses(tokenizer_dir: Path, tokenizer) -> None:
    async def body() -> None:
        fake = await _fake(tokenizer)
        fake.token_delay = 0.05
        async with _router(tokenizer_dir, [fake], max_inflight_requests=1) as url:
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
            with pytest.raises(openai.NotFoundError) as nf:
                await client.completions.create(model="gpt-9", prompt="x")
            assert nf.value.body["code"] == "model_not_found"
            with pytest.raises(openai.BadRequestError) as br:
                await client.completions.create(model="tiny", prompt="x", max_tokens=1000)
            assert br.value.body["param"] == "max_tokens"
            with pytest.raises(openai.BadRequestError) as br:
                await client.completions.create(model="tiny", prompt="x", temperature=-1)
            assert br.value.body["param"] == "temperature"
            async with httpx.AsyncClient(base_url=url) as http:
                r = await http.post("/v1/completions", content=b"{not json")
                assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
                slow = asyncio.create_task(http.post("/v1/completions", json={
                    "model": "tiny", "prompt": "Q", "max_tokens": 20}))
                await _until(lambda: bool(fake.in_progress))
                r = await http.post("/v1/completions", json={"model": "tiny", "prompt": "Q"})
                assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
                assert (await slow).status_code == 200
                assert (await http.get("/health")).json()["status"] == "ok"
        async with _router(tokenizer_dir, [], served_model_name="tiny") as url:
            async with httpx.AsyncClient(base_url=url) as http:
                r = await http.post("/v1/completions", json={"model": "tiny", "prompt": "Q"})
                assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
                assert (await http.get("/health")).status_code == 503
        async with _router(tokenizer_dir, [fake], api_key="sekrit") as url:
            bad = openai.AsyncOpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0)
            with pytest.raises(openai.AuthenticationError):
                await bad.models.list()
            good = openai.AsyncOpenAI(base_url=url + "/v1", api_key="sekrit", max_retries=0)
            assert (await good.models.list()).data[0].id == "tiny"
        await fake.stop()

    _run(body)


def test_a_streamed_token_passes_through_four_generator_frames(tokenizer_dir: Path, tokenizer,
                                                               monkeypatch) -> None:
    """From the worker client's ``generate`` (where a token line is parsed) to the SSE body's
    ``pump``: the worker stream, placement's ``serve`` loop, the choice's text, the pump. The
    frames are read off the live stack while a token line is being parsed."""
    import inspect

    import router.workers.client as worker_client

    stacks: list[list[str]] = []
    parse = worker_client.parse_generate_line

    def parse_and_look(obj):
        names, frame = [], inspect.currentframe()
        frame = frame.f_back if frame is not None else None      # generate's frame
        while frame is not None:
            names.append(frame.f_code.co_name)
            if frame.f_code.co_name == "pump":
                break
            frame = frame.f_back
        stacks.append(names)
        return parse(obj)

    monkeypatch.setattr(worker_client, "parse_generate_line", parse_and_look)

    async def body() -> None:
        fake = await _fake(tokenizer)
        async with _router(tokenizer_dir, [fake]) as url:
            async with httpx.AsyncClient(base_url=url) as http:
                r = await http.post("/v1/completions", json={
                    "model": "tiny", "prompt": "Q", "max_tokens": 3, "stream": True})
                assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
        await fake.stop()

    _run(body)
    assert len(stacks) == 4                         # three token lines and the final line
    assert stacks[0] == ["generate", "serve", "run_choice", "pump"]
