"""End to end on real processes: etcd, a store daemon, two prefill workers and one decode worker
(the tiny checkpoint, one torch thread each), and three routers on them (disaggregated,
colocated, auto). The official ``openai`` client must get transformers' greedy text in every
mode; the router must route a repeated prefix to the worker holding it, answer bad input with
the right status, move its metrics by the right amounts, and abort a request whose client
went away."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from openai import BadRequestError, NotFoundError, OpenAI

from engine.api.tokenizer import Tokenizer
from kvstore.secret import bearer_headers
from router.cluster.launcher import LocalCluster
from tests.router.cluster_probe import random_prompt, record, scrape, wait_until, worker_id

pytestmark = pytest.mark.integration

AUTO_THRESHOLD = 24
MODES = ("disaggregated", "colocated", "auto")
NO_EOS = {"ignore_eos": True}


@dataclass
class Env:
    cluster: LocalCluster
    routers: dict[str, str]       # mode -> URL
    empty_router: str             # a router whose cluster has no worker
    model: str
    log: Path                     # the request log every router here appends to
    tokenizer: Tokenizer

    def prompt(self, n: int, seed: int) -> list[int]:
        """``n`` random ids of the whole vocabulary (deterministic in ``seed``)."""
        return random_prompt(n, seed, self.tokenizer.vocab_size)

    def client(self, mode: str = "disaggregated") -> OpenAI:
        return OpenAI(base_url=f"{self.routers[mode]}/v1", api_key="unused", max_retries=0,
                      timeout=60)


@pytest.fixture(scope="module")
def env(cluster_factory, tiny_model_dir: Path) -> Env:
    cluster = cluster_factory(prefill=2, decode=1, mode="disaggregated")
    routers = {"disaggregated": cluster.router_url}
    routers["colocated"] = cluster.start_router(name="router-colocated", mode="colocated",
                                                expect_workers=3)
    routers["auto"] = cluster.start_router(name="router-auto", mode="auto",
                                           auto_threshold=AUTO_THRESHOLD, expect_workers=3)
    empty = cluster.start_router(name="router-empty", cluster=cluster.spec.cluster + "-empty",
                                 expect_workers=0)
    model = httpx.get(f"{cluster.router_url}/v1/models", trust_env=False).json()["data"][0]["id"]
    return Env(cluster, routers, empty, model, Path(cluster.spec.request_log),
               Tokenizer.from_dir(tiny_model_dir))


def _delta(before, after, name: str, **labels: str) -> float:
    return after.get(name, **labels) - before.get(name, **labels)


@pytest.mark.parametrize("mode", MODES)
def test_openai_client_gets_the_oracle_text(env: Env, oracle, mode: str) -> None:
    client, tok = env.client(mode), env.tokenizer
    seed = 10 * MODES.index(mode)

    def expect(prompt: list[int], n: int) -> str:
        return tok.decode(oracle(prompt, n))

    # completions, whole and streamed (a 40-token prompt: 2 full blocks + a partial one)
    prompt = env.prompt(40, seed)
    r = client.completions.create(model=env.model, prompt=prompt, max_tokens=12, temperature=0,
                                  extra_body=NO_EOS)
    assert r.choices[0].text == expect(prompt, 12)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (40, 12)
    assert r.choices[0].finish_reason == "length"
    rec = record(env.log, r.id)
    assert rec["status"] == "ok" and rec["output_tokens"] == 12
    assert rec["mode"] == {"auto": "auto-remote"}.get(mode, mode)   # 40 uncached >= threshold

    # ... and a prompt that ends in half a character ("€"'s lead byte): the stream starts
    # with the output's own bytes, exactly as decoding the output ids gives them.
    prompt = env.prompt(32, seed + 1) + tok.encode("€", add_special_tokens=False)[:1]
    stream = client.completions.create(model=env.model, prompt=prompt, max_tokens=9,
                                       temperature=0, stream=True, extra_body=NO_EOS)
    assert "".join(c.choices[0].text for c in stream) == expect(prompt, 9)

    # chat, whole and streamed
    messages = [{"role": "system", "content": "You route requests."},
                {"role": "user", "content": f"Where does prefix {mode} live?"}]
    ids = tok.encode_chat(messages)
    chat = client.chat.completions.create(model=env.model, messages=messages, max_tokens=10,
                                          temperature=0, extra_body=NO_EOS)
    assert chat.choices[0].message.content == expect(ids, 10)
    assert chat.usage.prompt_tokens == len(ids)
    stream = client.chat.completions.create(model=env.model, messages=messages, max_tokens=10,
                                            temperature=0, stream=True, extra_body=NO_EOS)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == expect(ids, 10)


def test_n_choices_are_independent_requests(env: Env, oracle) -> None:
    prompt = env.prompt(20, 99)
    r = env.client().completions.create(model=env.model, prompt=prompt, max_tokens=6, n=2,
                                        temperature=0, extra_body=NO_EOS)
    assert sorted(c.index for c in r.choices) == [0, 1]
    expect = env.tokenizer.decode(oracle(prompt, 6))
    assert [c.text for c in r.choices] == [expect, expect]
    assert r.usage.completion_tokens == 12
    assert record(env.log, r.id, 0)["request_id"] != record(env.log, r.id, 1)["request_id"]


def test_auto_mode_prefills_short_uncached_parts_locally(env: Env) -> None:
    client, url = env.client("auto"), env.routers["auto"]
    short, long = env.prompt(10, 201), env.prompt(80, 202)
    again = long + [7, 8, 9, 10]      # 80 tokens (5 blocks) now cached, 4 uncached
    before = scrape(url)
    recs = []
    for prompt in (short, long, again):
        r = client.completions.create(model=env.model, prompt=prompt, max_tokens=4,
                                      temperature=0, extra_body=NO_EOS)
        assert r.usage.completion_tokens == 4
        recs.append(record(env.log, r.id))
    after = scrape(url)
    assert [r["mode"] for r in recs] == ["auto-local", "auto-remote", "auto-local"]
    # The metric's kinds are the log's modes (one Route vocabulary).
    assert _delta(before, after, "kvrouter_route_kind_total", kind="auto-local") == 2
    assert _delta(before, after, "kvrouter_route_kind_total", kind="auto-remote") == 1
    cached = recs[2]["prefill_stats"]                   # its one phase, "full"
    assert cached["device_hit_tokens"] + cached["store_hit_tokens"] == 80 and cached["computed_prompt_tokens"] == 4


def test_repeated_prefix_goes_to_the_prefill_worker_holding_it(env: Env) -> None:
    client, url = env.client(), env.routers["disaggregated"]
    ids = {worker_id(u, env.cluster.secret): u for n, u in env.cluster.worker_urls.items()
           if n.startswith("prefill")}
    prefix = env.prompt(160, 300)                       # 10 full blocks
    first = client.completions.create(model=env.model, prompt=prefix + [5, 6, 7], max_tokens=2,
                                      extra_body=NO_EOS)
    holder = record(env.log, first.id)["prefill_worker"]
    other = next(w for w in ids if w != holder)
    # The holder has published its blocks (the router follows the same event stream).
    auth = bearer_headers(env.cluster.secret)           # the worker API needs the secret
    wait_until(lambda: len(httpx.get(f"{ids[holder]}/snapshot", trust_env=False,
                                     headers=auth).json()["blocks"]) >= 10,
               what="the holder's stored blocks")
    before = scrape(url)
    for i in range(3):
        r = client.completions.create(model=env.model, prompt=prefix + [10 + i, 20 + i, 30 + i, 40 + i],
                                      max_tokens=2, extra_body=NO_EOS)
        rec = record(env.log, r.id)
        assert rec["prefill_worker"] == holder
        assert rec["phases"][0]["stats"]["device_hit_tokens"] == 160
        assert rec["prefill_stats"]["computed_prompt_tokens"] == 4   # only the new suffix is computed
        assert r.usage.prompt_tokens_details.cached_tokens == 160
    after = scrape(url)
    decisions = "kvrouter_routing_decisions_total"
    assert _delta(before, after, decisions, worker=holder, phase="prefill") == 3
    assert _delta(before, after, decisions, worker=other, phase="prefill") == 0
    assert _delta(before, after, "kvrouter_prefix_hit_tokens_total", tier="device") >= 3 * 160


def test_metrics_move_by_the_right_amounts(env: Env) -> None:
    url = env.routers["disaggregated"]
    prompt = env.prompt(50, 400)                        # 3 full blocks (48 tokens) + 2
    before = scrape(url)
    r = env.client().completions.create(model=env.model, prompt=prompt, max_tokens=7,
                                        temperature=0, extra_body=NO_EOS)
    after = scrape(url)
    rec = record(env.log, r.id)
    d = lambda name, **labels: _delta(before, after, name, **labels)  # noqa: E731
    assert d("kvrouter_prompt_tokens_total") == 50
    assert d("kvrouter_generation_tokens_total") == 7
    assert d("kvrouter_requests_total", endpoint="completion", status="200") == 1
    assert d("kvrouter_route_kind_total", kind="disaggregated") == 1
    assert d("kvrouter_routing_decisions_total", worker=rec["prefill_worker"], phase="prefill") == 1
    assert d("kvrouter_routing_decisions_total", worker=rec["decode_workers"][0], phase="decode") == 1
    assert d("kvrouter_time_to_first_token_seconds_count") == 1
    # The prompt is new: the prefill computes all of it and saves its 3 full blocks; the
    # decode worker loads exactly those from the store.
    pre, dec = rec["prefill_stats"], rec["decode_stats"]
    both = lambda name: pre[name] + dec[name]  # noqa: E731
    assert pre["computed_prompt_tokens"] == 50 and dec["store_hit_tokens"] == 48
    assert d("kvrouter_prefix_hit_tokens_total", tier="store") == 48
    assert d("kvrouter_computed_prompt_tokens_total") == both("computed_prompt_tokens")
    assert both("kv_bytes_saved") > 0 and both("kv_bytes_loaded") == both("kv_bytes_saved")
    assert d("kvrouter_kv_transfer_bytes_total", direction="save") == both("kv_bytes_saved")
    assert d("kvrouter_kv_transfer_bytes_total", direction="load") == both("kv_bytes_loaded")
    timeline = rec["timeline"]
    assert (timeline["prefill_start"] <= timeline["prefill_end"] <= timeline["first_token"]
            <= timeline["transfer_start"] <= timeline["decode_end"] <= timeline["end"])


@pytest.mark.parametrize("body, status, param", [
    ({"prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens"),
    ({"prompt": 42}, 400, "prompt"),
    ({"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 5000}, 400, "max_tokens"),
    ({"prompt": [5] * 2048, "max_tokens": 1}, 400, "prompt"),
    ({"prompt": "hi", "model": "no-such-model"}, 404, "model"),
])
def test_bad_input_gets_its_status(env: Env, body: dict, status: int, param: str) -> None:
    resp = httpx.post(f"{env.routers['disaggregated']}/v1/completions",
                      json={"model": env.model, **body}, timeout=10, trust_env=False)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and error["message"]


def test_errors_reach_the_openai_client_typed(env: Env) -> None:
    client = env.client()
    with pytest.raises(BadRequestError):
        client.chat.completions.create(model=env.model, messages="not a list", max_tokens=2)
    with pytest.raises(NotFoundError):
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)


def test_cache_salt_separates_tenants(env: Env) -> None:
    client, prompt = env.client(), env.prompt(64, 600)        # 4 full blocks
    recs = []
    for salt in ("tenant-a", "tenant-a", "tenant-b"):
        r = client.completions.create(model=env.model, prompt=prompt, max_tokens=2,
                                      extra_body={**NO_EOS, "cache_salt": salt})
        recs.append(record(env.log, r.id))
    first, same, other = (r["prefill_stats"] for r in recs)
    assert first["computed_prompt_tokens"] == 64
    # Same salt: the router's salted keys find the worker holding the blocks, which reuses them.
    assert recs[1]["prefill_worker"] == recs[0]["prefill_worker"]
    assert same["device_hit_tokens"] >= 48 and same["computed_prompt_tokens"] <= 16
    # Another salt shares nothing, in the device cache or in the store.
    assert other["computed_prompt_tokens"] == 64 and other["store_hit_tokens"] == 0
    assert recs[2]["phases"][0]["stats"]["device_hit_tokens"] == 0


def test_api_key_is_required_when_set(env: Env) -> None:
    url = env.cluster.start_router(name="router-keyed", api_key="s3cret", expect_workers=3)
    body = {"model": env.model, "prompt": env.prompt(8, 700), "max_tokens": 2}
    denied = httpx.post(f"{url}/v1/completions", json=body, timeout=10, trust_env=False)
    assert denied.status_code == 401 and denied.json()["error"]["code"] == "invalid_api_key"
    r = OpenAI(base_url=f"{url}/v1", api_key="s3cret", max_retries=0).completions.create(**body)
    assert r.usage.completion_tokens >= 1
    assert httpx.get(f"{url}/health", trust_env=False).status_code == 200   # no key needed


def test_no_worker_is_503(env: Env) -> None:
    resp = httpx.post(f"{env.empty_router}/v1/completions",
                      json={"model": env.model, "prompt": "hi", "max_tokens": 2}, timeout=10,
                      trust_env=False)
    assert resp.status_code == 503, resp.text
    assert resp.json()["error"]["type"] == "service_unavailable"
    assert httpx.get(f"{env.empty_router}/health", trust_env=False).status_code == 503


def test_stop_string_ends_the_choice_and_frees_its_worker(env: Env, oracle) -> None:
    decode_url = env.cluster.worker_urls["decode-0"]
    prompt = env.prompt(30, 800)
    text = env.tokenizer.decode(oracle(prompt, 200))
    # A 3-character ASCII stop string first seen well into the text.
    k = next(i for i in range(20, len(text) - 3)
             if text[i:i + 3].isascii() and text[i:i + 3].isprintable() and text.find(text[i:i + 3]) == i)
    stop = text[k:k + 3]
    aborted = lambda: scrape(decode_url).get("kvengine_requests_finished_total",  # noqa: E731
                                             finish_reason="abort")
    before = aborted()
    r = env.client().completions.create(model=env.model, prompt=prompt, max_tokens=200,
                                        temperature=0, stop=[stop], extra_body=NO_EOS)
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == text[:k]
    assert r.usage.completion_tokens < 200
    wait_until(lambda: aborted() == before + 1, 10, "the decode worker's abort")
    assert record(env.log, r.id)["status"] == "closed"


def test_client_disconnect_aborts_the_request_on_its_workers(env: Env) -> None:
    decode_url = env.cluster.worker_urls["decode-0"]
    aborted = lambda: scrape(decode_url).get("kvengine_requests_finished_total",  # noqa: E731
                                             finish_reason="abort")
    before = aborted()
    body = {"model": env.model, "prompt": env.prompt(20, 500), "max_tokens": 1500,
            "stream": True, "ignore_eos": True}
    response_id, chunks = None, 0
    with httpx.stream("POST", f"{env.routers['disaggregated']}/v1/completions", json=body,
                      timeout=30, trust_env=False) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                response_id = response_id or httpx.Response(200, content=line[6:]).json()["id"]
                chunks += 1
                if chunks == 5:
                    break                                   # the client goes away mid-stream
    wait_until(lambda: aborted() == before + 1, 10, "the decode worker's abort")
    wait_until(lambda: scrape(decode_url).get("kvengine_requests_running") == 0, 10,
               "the decode worker to hold no running request")
    rec = record(env.log, response_id)
    assert rec["status"] == "closed" and rec["output_tokens"] < 1500


@pytest.mark.slow
def test_default_model_disaggregated_matches_transformers(cluster_factory) -> None:
    """SmolLM2-135M-Instruct through prefill -> store -> decode: transformers' greedy reply."""
    from engine.model.convert import ensure_default_model
    from tests.engine.hf_oracle import hf_greedy

    model_dir = ensure_default_model(progress=False)
    cluster = cluster_factory(prefill=1, decode=1, model=str(model_dir), store_memory="256M")
    tok = Tokenizer.from_dir(model_dir)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    expect, _ = hf_greedy(model_dir, tok.encode_chat(messages), 24)
    stops = [i for i, t in enumerate(expect) if t in tok.eos_token_ids]
    expect = expect[: stops[0]] if stops else expect       # the engine stops at EOS
    client = OpenAI(base_url=f"{cluster.router_url}/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(model=model_dir.name, messages=messages,
                                           max_tokens=24, temperature=0)
    assert reply.choices[0].message.content == tok.decode(expect)
    assert "Paris" in reply.choices[0].message.content
