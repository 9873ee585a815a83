"""The router in front of vLLM instances (``kvrouter up --engine vllm``: ``vllm_pd``): the
official ``openai`` client against the router, the prompt prefilled on the producer, its blocks
through the store, the rest decoded on the consumer.

The text equals what the same vLLM answers with a device prefix-cache hit of the prompt (the
producer's own cache, asked directly afterwards); the decode instance computes less than one
block of the prompt (vLLM's own counters) and loads the rest through the connector (its
counters on vLLM's ``/metrics``); streamed chat works the same way. Last, the store is killed:
the instances serve on, computing, with transformers' text; a fresh store comes back and P/D
hands every block over again.
"""

from __future__ import annotations

import time

import httpx
import pytest

from tests.integrations.conftest import ROOT, VllmPD

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MAX_TOKENS = 16


def _text_prompt(pd: VllmPD, tokens: int) -> str:
    """About ``tokens`` tokens of this repository's architecture notes."""
    ids = pd.tokenizer().encode((ROOT / "docs" / "architecture.md").read_text()).ids
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
    assert direct["usage"]["prompt_tokens_details"]["cached_tokens"] >= n_prompt // pd.block_size * pd.block_size - pd.block_size
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
    # The session's last vLLM test: it kills the store and brings a fresh one back.
    from tests.engine.hf_oracle import assert_same_greedy, hf_greedy

    pd = vllm_pd
    store = pd.cluster.child("store")
    assert store.proc is not None
    store.proc.kill()
    store.proc.wait()
    ids = pd.tokenizer().encode((ROOT / "docs" / "architecture.md").read_text()).ids[20000:20900]
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
