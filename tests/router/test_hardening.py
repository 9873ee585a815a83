"""The router's HTTP face under hostile or unusual input, over real HTTP (uvicorn)
against fake workers: every error is OpenAI's shape with its status, the sampling fields vLLM
accepts reach the workers, the ones it knows and we do not implement are refused, /health
names each dependency, a dead store is routed around and said so, worker calls carry the
cluster secret, and ``kvrouter serve`` exits non-zero when it did not start."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from kvstore.proc import free_port
from router.placement.request_log import RequestLog
from router.workers.store import StoreView
from tests.router.fake_worker import FakeWorker
from tests.router.test_app import _fake, _router, _run

OPENAI_ERROR_KEYS = {"message", "type", "param", "code"}


def _error(resp: httpx.Response, status: int, param: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    err = resp.json()["error"]
    assert set(err) == OPENAI_ERROR_KEYS and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


def test_hostile_bodies_get_4xx_in_openai_shape(tokenizer_dir: Path, tokenizer) -> None:
    async def body() -> None:
        fake = await _fake(tokenizer)
        async with _router(tokenizer_dir, [fake], max_body_bytes=4096) as url:
            async with httpx.AsyncClient(base_url=url) as http:
                # A lone surrogate reached the tokenizer (TypeError: 500, plain text).
                raw = b'{"model": "tiny", "prompt": "\\ud800", "max_tokens": 2}'
                _error(await http.post("/v1/completions", content=raw), 400, "prompt")
                raw = b'{"model": "tiny", "messages": [{"role": "user", "content": "a\\udfffb"}]}'
                _error(await http.post("/v1/chat/completions", content=raw), 400,
                       "messages[0].content")
                raw = (b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], '
                       b'"chat_template_kwargs": {"k": ["\\ud800"]}}')
                _error(await http.post("/v1/chat/completions", content=raw), 400,
                       "chat_template_kwargs.k")
                # A paired surrogate escape is a character like any other.
                raw = b'{"model": "tiny", "prompt": "\\ud83d\\ude00", "max_tokens": 2}'
                assert (await http.post("/v1/completions", content=raw)).status_code == 200
                # 100,000 nested '[' (a RecursionError: 500, plain text) on both endpoints.
                for path in ("/v1/completions", "/v1/chat/completions"):
                    async with _router(tokenizer_dir, [fake]) as big:     # default body limit
                        r = await http.post(big + path, content=b"[" * 100_000)
                    assert r.status_code in (400, 413), r.text
                    _error(r, r.status_code)
                # Past --max-body-bytes: 413, declared or chunked, before any parsing.
                r = await http.post("/v1/completions", content=b"{" * 5000)
                assert _error(r, 413)["code"] == "request_too_large"

                async def chunks() -> AsyncIterator[bytes]:
                    for _ in range(10):
                        yield b" " * 1000
                r = await http.post("/v1/completions", content=chunks())
                _error(r, 413)
                # Routing's own errors.
                _error(await http.get("/v1/nothing-here"), 404)
                r = await http.get("/v1/completions")
                _error(r, 405)
                assert "POST" in r.headers.get("allow", "")
                _error(await http.post("/v1/completions", content=b"[1, 2]"), 400)
        await fake.stop()

    _run(body)


@pytest.mark.parametrize("extra, param", [
    ({"echo": -1e30}, "echo"), ({"echo": {}}, "echo"), ({"echo": True}, "echo"),
    ({"suffix": "end"}, "suffix"), ({"best_of": 3}, "best_of"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"use_beam_search": True}, "use_beam_search"), ({"guided_regex": "a+"}, "guided_regex"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"min_p": 1.5}, "min_p"),
    ({"min_tokens": -1}, "min_tokens"), ({"min_tokens": 5, "max_tokens": 3}, "min_tokens"),
    ({"logit_bias": {"x": 1}}, "logit_bias"), ({"logit_bias": {"5": 500}}, "logit_bias"),
    ({"frequency_penalty": 2.5}, "frequency_penalty"),
])
def test_fields_vllm_knows_and_bad_values_are_refused_by_name(extra: dict, param: str) -> None:
    from router.http.errors import BadRequest
    from router.http.openai_types import CompletionRequest

    with pytest.raises(BadRequest) as info:
        CompletionRequest.parse({"model": "m", "prompt": "x", **extra})
    assert info.value.param == param and info.value.status == 400


def test_chat_refuses_tools_and_echo_but_takes_neutral_values() -> None:
    from router.http.errors import BadRequest
    from router.http.openai_types import ChatRequest

    msgs = [{"role": "user", "content": "x"}]
    for extra, param in (({"tools": [{"type": "function"}]}, "tools"), ({"echo": True}, "echo"),
                         ({"tool_choice": "required"}, "tool_choice")):
        with pytest.raises(BadRequest) as info:
            ChatRequest.parse({"model": "m", "messages": msgs, **extra})
        assert info.value.param == param
    req = ChatRequest.parse({"model": "m", "messages": msgs, "tools": [], "tool_choice": "none",
                             "echo": False, "response_format": {"type": "text"}})
    assert req.options.model == "m"


def test_sampling_fields_reach_the_worker_and_unknown_ones_are_named(
        tokenizer_dir: Path, tokenizer, caplog: pytest.LogCaptureFixture) -> None:
    async def body() -> None:
        fake = await _fake(tokenizer)
        async with _router(tokenizer_dir, [fake]) as url:
            async with httpx.AsyncClient(base_url=url) as http:
                with caplog.at_level(logging.WARNING, "router.http.openai_types"):
                    r = await http.post("/v1/completions", json={
                        "model": "tiny", "prompt": "Q", "max_tokens": 4,
                        "repetition_penalty": 1.3, "frequency_penalty": 0.5,
                        "presence_penalty": -0.5, "min_p": 0.1, "min_tokens": 2,
                        "logit_bias": {"7": 3.0, "11": -100}, "no_such_field": 1})
                assert r.status_code == 200, r.text
                assert "no_such_field" in caplog.text
                s = fake.requests[-1].sampling
                assert (s.repetition_penalty, s.frequency_penalty, s.presence_penalty, s.min_p,
                        s.min_tokens) == (1.3, 0.5, -0.5, 0.1, 2)
                assert s.logit_bias == {7: 3.0, 11: -100.0}
                r = await http.post("/v1/chat/completions", json={
                    "model": "tiny", "messages": [{"role": "user", "content": "x"}],
                    "max_completion_tokens": 3, "repetition_penalty": 1.1, "min_tokens": 1})
                assert r.status_code == 200, r.text
                s = fake.requests[-1].sampling
                assert (s.repetition_penalty, s.min_tokens) == (1.1, 1)
                vocab = tokenizer.vocab_size
                r = await http.post("/v1/completions", json={
                    "model": "tiny", "prompt": "Q", "logit_bias": {str(vocab): 1.0}})
                _error(r, 400, "logit_bias")
                # /docs has the real request schemas.
                doc = (await http.get("/openapi.json")).json()
                schemas = doc["components"]["schemas"]
                assert {"CompletionBody", "ChatBody", "ChatMessage"} <= set(schemas)
                assert "repetition_penalty" in schemas["CompletionBody"]["properties"]
        await fake.stop()

    _run(body)


def test_api_key_guards_everything_but_health_and_metrics(tokenizer_dir: Path, tokenizer) -> None:
    async def body() -> None:
        fake = await _fake(tokenizer)
        async with _router(tokenizer_dir, [fake], api_key="k") as url:
            async with httpx.AsyncClient(base_url=url) as http:
                for path in ("/docs", "/openapi.json", "/v1/models", "/nowhere"):
                    _error(await http.get(path), 401)
                assert (await http.get("/health")).status_code == 200
                assert (await http.get("/metrics")).status_code == 200
                ok = await http.get("/openapi.json", headers={"Authorization": "Bearer k"})
                assert ok.status_code == 200
        await fake.stop()

    _run(body)


class _DeadStore:
    def prefix_len(self, keys) -> int:
        raise ConnectionRefusedError("the store daemon is gone")

    def stats(self) -> dict:
        raise ConnectionRefusedError("the store daemon is gone")

    def close(self) -> None:
        pass


def test_a_dead_store_is_reported_and_routed_around(tokenizer_dir: Path, tokenizer,
                                                    tmp_path: Path) -> None:
    """/health said "ok" with the store dead, and a request to be disaggregated went through
    it anyway. Now: degraded (200), the store named down, and the request prefilled where it
    decodes, logged as route ``store-down``."""
    async def body() -> None:
        prefill = await FakeWorker("p0", "prefill").start()
        decode = await FakeWorker("d0", "decode").start()
        store = StoreView(_DeadStore, probe_interval=0.05, where="127.0.0.1:1")
        log_path = tmp_path / "requests.jsonl"
        async with _router(tokenizer_dir, [prefill, decode], mode="disaggregated", store=store,
                           request_log=RequestLog(str(log_path))) as url:
            async with httpx.AsyncClient(base_url=url) as http:
                r = await http.get("/health")
                assert r.status_code == 200
                health = r.json()
                assert health["status"] == "degraded" and health["down"] == ["store"]
                deps = health["dependencies"]
                assert deps["store"]["status"] == "down" and "gone" in deps["store"]["detail"]
                assert deps["etcd"]["status"] == "ok"
                assert deps["workers"]["prefill"] == 1 and deps["workers"]["decode"] == 1
                r = await http.post("/v1/completions", json={"model": "tiny", "prompt": "Q",
                                                             "max_tokens": 3})
                assert r.status_code == 200, r.text
                assert not prefill.requests
                assert [g.phase for g in decode.requests] == ["full"]
                metrics = (await http.get("/metrics")).text
                assert 'kvrouter_route_kind_total{kind="store-down"} 1.0' in metrics
        rec = json.loads(log_path.read_text().splitlines()[-1])
        assert rec["mode"] == "store-down" and rec["decode_workers"] == ["d0"]
        assert rec["prefill_worker"] is None
        await prefill.stop()
        await decode.stop()

    _run(body)


def test_worker_calls_carry_the_cluster_secret(tokenizer_dir: Path, tokenizer) -> None:
    from kvstore.secret import bearer_headers
    from router.workers.pool import StaticMembership, WorkerPool

    async def body() -> None:
        fake = await _fake(tokenizer)
        pool = WorkerPool(StaticMembership([fake.info]), headers=bearer_headers("s3"))
        async with _router(tokenizer_dir, [fake], pool=pool) as url:
            async with httpx.AsyncClient(base_url=url) as http:
                r = await http.post("/v1/completions", json={"model": "tiny", "prompt": "Q",
                                                             "max_tokens": 2})
                assert r.status_code == 200
        assert fake.authorization and set(fake.authorization) == {"Bearer s3"}
        await fake.stop()

    _run(body)


def test_serve_exits_non_zero_when_the_app_does_not_start(tokenizer_dir: Path, monkeypatch,
                                                          capsys) -> None:
    """uvicorn's ``Server.run`` returns normally when the app's start-up fails; the exit code
    was 0."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI

    import router.server_main as server_main
    from router.config import RouterConfig

    @asynccontextmanager
    async def failing(_app: FastAPI):
        raise RuntimeError("etcd went away during start-up")
        yield

    def build_app(config: RouterConfig) -> server_main.RouterParts:
        return server_main.RouterParts(FastAPI(lifespan=failing), RequestLog(None))

    monkeypatch.setattr(server_main, "build_app", build_app)
    config = RouterConfig(model_dir=str(tokenizer_dir), port=free_port())
    assert server_main.run_router(config, log_level="critical") == 2
    assert "cannot start" in capsys.readouterr().err
