"""The router's two gates (``kvstore.http_auth.BearerGate``) over real HTTP: ``/admin/`` takes
the cluster secret only, everything else the API key only, /health and /metrics stay open, a
401 is an OpenAI error body, and a stream passes the gate whole."""

from __future__ import annotations

import json
from pathlib import Path

import httpx

from kvstore.secret import bearer_headers
from tests.router.test_app import ANSWER, _fake, _router, _run

SECRET, KEY = "cluster-secret", "api-key"


def _denied(resp: httpx.Response) -> dict:
    assert resp.status_code == 401, resp.text
    assert resp.headers["www-authenticate"] == "Bearer"
    err = resp.json()["error"]
    assert err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error"
    return err


def test_admin_takes_the_cluster_secret_and_the_rest_the_api_key(tokenizer_dir: Path, tokenizer) -> None:
    async def body() -> None:
        fake = await _fake(tokenizer)
        async with _router(tokenizer_dir, [fake], cluster_secret=SECRET, api_key=KEY) as url:
            async with httpx.AsyncClient(base_url=url) as http:
                for headers in (None, bearer_headers(KEY)):
                    err = _denied(await http.get("/admin/scaling", headers=headers))
                    assert "cluster secret" in err["message"]
                assert (await http.get("/admin/scaling", headers=bearer_headers(SECRET))).status_code == 200
                for headers in (None, bearer_headers(SECRET)):
                    assert "API key" in _denied(await http.get("/v1/models", headers=headers))["message"]
                assert (await http.get("/v1/models", headers=bearer_headers(KEY))).status_code == 200
                assert (await http.get("/health")).status_code == 200
                assert (await http.get("/metrics")).status_code == 200
                async with http.stream("POST", "/v1/completions", headers=bearer_headers(KEY), json={
                        "model": "tiny", "prompt": "Q", "max_tokens": 4, "stream": True}) as r:
                    assert r.status_code == 200
                    lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
                assert lines[-1] == "data: [DONE]"
                text = "".join(json.loads(x[6:])["choices"][0]["text"] for x in lines[:-1])
                assert text and ANSWER.startswith(text)
        await fake.stop()

    _run(body)


def test_without_an_api_key_only_admin_is_guarded(tokenizer_dir: Path, tokenizer) -> None:
    async def body() -> None:
        fake = await _fake(tokenizer)
        async with _router(tokenizer_dir, [fake], cluster_secret=SECRET) as url:
            async with httpx.AsyncClient(base_url=url) as http:
                assert (await http.get("/v1/models")).status_code == 200
                _denied(await http.get("/admin/scaling"))
                assert (await http.get("/admin/scaling", headers=bearer_headers(SECRET))).status_code == 200
        await fake.stop()

    _run(body)
