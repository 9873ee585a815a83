"""The router in front of vLLM instances (``kvrouter up --engine vllm``: ``vllm_pd``): the
official ``openai`` client against the router, the prompt prefilled on the producer, its blocks
through the store, the rest decoded on the consumer.

The text equals what the same vLLM answers with a device prefix-cache hit of the prompt (the
producer's own cache, asked directly afterwards); the decode instance computes less than one
block of the prompt (vLLM's own counters) and loads the rest through the connector (its
counters on vLLM's ``/metrics``); streamed chat works the same way. Then the store is killed:
the instances serve on, computing, with transformers' text; a fresh store comes back and P/D
hands every block over again. Last, a second decode instance joins and the one streaming a
request is killed mid-stream: the router resumes it on the other.
"""

from __future__ import annotations

import json
import signal
import time

import httpx
import pytest

from tests.integrations.vllm_procs import ROOT, VllmPD, VllmServer, registered

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MAX_TOKENS = 16


def _text_prompt(pd: VllmPD, tokens: int) -> str:
    """About ``tokens`` tokens of this repository's benchmark notes."""
    ids = pd.tokenizer().encode((ROOT / "docs" / "benchmarks.md").read_text()).ids
    return pd.tokenizer().decode(ids[2000:2000 + tokens])


def test_openai_client_through_the_router_prefills_on_one_vllm_and_decodes_on_the_other(vllm_pd: VllmPD) -> None:
    from openai import OpenAI

    pd = vllm_pd
    prompt = _text_prompt(pd, 1500)
    n_prompt = len(pd.tokenizer().encode(prompt).ids)
    before = pd.consumer.prompt_tokens_by_source()
    loaded_before = pd.consumer.metric("vllm:kvstore_loaded_blocks_total")
    client = OpenAI(base_url=pd.router_url + "/v1", api_key="none", timeout=300)
    out = client.completions.create(model=pd.model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    text = out.choices[0].text
    assert out.usage is not None and out.usage.completion_tokens == MAX_TOKENS

    after = pd.consumer.prompt_tokens_by_source()
    computed = after.get("local_compute", 0) - before.get("local_compute", 0)
    loaded = after.get("external_kv_transfer", 0) - before.get("external_kv_transfer", 0)
    assert computed < pd.block_size, (computed, loaded)   # the decode recomputed under a block
    assert loaded >= (n_prompt // pd.block_size - 1) * pd.block_size
    assert pd.consumer.metric("vllm:kvstore_loaded_blocks_total") - loaded_before >= n_prompt // pd.block_size - 1

    # The reference: the same vLLM, the prompt a device prefix-cache hit on the producer.
    direct = httpx.post(pd.producer.url + "/v1/completions", headers=pd.headers, timeout=300,
                        json={"model": pd.model, "prompt": prompt, "max_tokens": MAX_TOKENS,
                              "temperature": 0}).json()
    assert (direct["usage"]["prompt_tokens_details"]["cached_tokens"]
            >= n_prompt // pd.block_size * pd.block_size - pd.block_size)
    assert text == direct["choices"][0]["text"]

    # Streamed chat through the router: the same path, text as vLLM's.
    messages = [{"role": "user", "content": "What is a KV cache? Answer in one sentence."}]
    chunks = client.chat.completions.create(model=pd.model, messages=messages,  # type: ignore[arg-type]
                                            max_tokens=MAX_TOKENS, temperature=0, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reference = httpx.post(pd.producer.url + "/v1/chat/completions", headers=pd.headers, timeout=300,
                           json={"model": pd.model, "messages": messages, "max_tokens": MAX_TOKENS,
                                 "temperature": 0}).json()
    assert streamed == reference["choices"][0]["message"]["content"]


def test_a_killed_store_is_a_miss_and_its_return_is_found(vllm_pd: VllmPD) -> None:
    # It kills the store and brings a fresh one back.
    from tests.engine.hf_oracle import assert_same_greedy, hf_greedy

    pd = vllm_pd
    store = pd.cluster.child("store")
    assert store.proc is not None
    store.proc.kill()
    store.proc.wait()
    ids = pd.tokenizer().encode((ROOT / "docs" / "benchmarks.md").read_text()).ids[20000:20900]
    before = pd.consumer.prompt_tokens_by_source()
    resp = httpx.post(pd.consumer.url + "/v1/completions", headers=pd.headers, timeout=600, json={
        "model": pd.model, "prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True})
    assert resp.status_code == 200, resp.text
    after = pd.consumer.prompt_tokens_by_source()
    assert after.get("local_compute", 0) - before.get("local_compute", 0) == len(ids)
    theirs, margins = hf_greedy(pd.model_dir, ids, MAX_TOKENS)
    assert assert_same_greedy(list(resp.json()["choices"][0]["token_ids"]), theirs, margins) <= 1
    # The store comes back (a fresh daemon, empty): P/D of a prompt the producer holds as a
    # device hit still hands every block over: the producer saves the hits the store lost.
    pd.cluster.respawn(store)
    deadline = time.monotonic() + 60
    while not pd.cluster.is_ready(store):
        assert time.monotonic() < deadline, "the store did not come back"
        time.sleep(0.2)
    time.sleep(6.0)   # the killed daemon's registration expires (its TTL): one store in etcd
    prompt = _text_prompt(pd, 1500)   # the first test's: the producer's device cache holds it
    from openai import OpenAI

    before = pd.consumer.prompt_tokens_by_source()
    client = OpenAI(base_url=pd.router_url + "/v1", api_key="none", timeout=300)
    client.completions.create(model=pd.model, prompt=prompt, max_tokens=4, temperature=0)
    after = pd.consumer.prompt_tokens_by_source()
    assert after.get("local_compute", 0) - before.get("local_compute", 0) < pd.block_size


def test_a_vllm_decode_killed_mid_stream_is_resumed_on_another(vllm_pd: VllmPD) -> None:
    """A second decode instance joins (registered by its connector, found by the router in
    etcd); the instance streaming a request is killed after some tokens; the router resumes
    the stream on the other one (the prompt and the tokens so far as its prompt) and the
    client gets transformers' greedy text, once. The survivor is the cluster's consumer from
    then on."""
    from tests.engine.hf_oracle import assert_same_greedy, hf_greedy

    pd = vllm_pd
    cluster = pd.cluster
    extra = cluster.add_worker("decode")
    deadline = time.monotonic() + 420
    while not cluster.is_ready(extra):
        assert extra.alive() and time.monotonic() < deadline, "the second decode instance did not start"
        time.sleep(0.5)
    assert extra.member_id is not None
    info = registered(cluster, extra.member_id)
    second = VllmServer("kv_consumer", extra.address, extra.log_path, extra.member_id,
                        info.kv_events or "", info.kv_events_replay or "")
    second.warm_up(pd.model, pd.secret)
    deadline = time.monotonic() + 30
    while _router_metric(pd, 'kvrouter_workers{role="decode"}') < 2:
        assert time.monotonic() < deadline, "the router never saw the second decode instance"
        time.sleep(0.2)

    n_out = 96   # several seconds of decoding: finding the serving instance takes up to a second
    ids = pd.tokenizer().encode((ROOT / "docs" / "benchmarks.md").read_text()).ids[30000:30300]
    failovers = _failovers(pd)
    got: list[int] = []
    with httpx.stream("POST", pd.router_url + "/v1/completions", timeout=600, json={
            "model": pd.model, "prompt": ids, "max_tokens": n_out, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}) as resp:
        assert resp.status_code == 200
        killed: VllmServer | None = None
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:]).get("choices", []):
                got += choice.get("token_ids") or []
            if killed is None and len(got) >= 8:
                killed = _serving((pd.consumer, second))
                name = next(c.name for c in cluster.children if c.address == killed.url)
                cluster.child(name).signal_group(signal.SIGKILL)   # the server and its engine core
                at_kill = len(got)
    assert killed is not None
    assert at_kill < n_out, f"the stream had ended ({at_kill} tokens read) before the kill"
    assert _failovers(pd) - failovers == 1
    theirs, margins = hf_greedy(pd.model_dir, ids, n_out)
    assert len(got) == n_out
    assert assert_same_greedy(got, theirs, margins) <= 1
    pd.consumer = second if killed is pd.consumer else pd.consumer


def _serving(servers: tuple[VllmServer, ...]) -> VllmServer:
    """The one of ``servers`` generating now: its generated-token counter grows (vLLM's running
    gauge is no witness: an instance that went idle keeps its last value)."""
    deadline = time.monotonic() + 10
    while True:
        before = [s.metric("vllm:generation_tokens_total") for s in servers]
        time.sleep(0.3)
        busy = [s for s, b in zip(servers, before) if s.metric("vllm:generation_tokens_total") > b]
        if len(busy) == 1:
            return busy[0]
        assert time.monotonic() < deadline, f"{len(busy)} decode instances are generating"


def _router_metric(pd: VllmPD, series: str) -> float:
    """One series of the router's ``/metrics``, e.g. ``kvrouter_workers{role="decode"}``."""
    for line in httpx.get(pd.router_url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(series + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _failovers(pd: VllmPD) -> float:
    return _router_metric(pd, 'kvrouter_failovers_total{kind="decode_resume"}')
