"""``router.workers.vllm_client``: the router's worker interface over a real vLLM server's
OpenAI-compatible API (``vllm_pd``: a prefill and a decode instance sharing the store through
the connector, on the default model).

Against vLLM: a streamed greedy request equals vLLM's own non-streamed answer (and its
logprobs come back as ours); a prefill on one instance and its decode on the other, through
the client's ``kv_transfer_params``, equal one greedy run while the decode computes less than
a block of the prompt (vLLM's own counters); a frequency penalty continues exactly over tokens
produced elsewhere (a presence penalty there is refused); 4xx, a missing secret and a dead port are the right errors;
``abort`` ends a long stream and frees it in vLLM; ``follow_events`` keys vLLM's KV events
into the index. Without vLLM: the request body, what is refused, ``follow_events`` with no
event source.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

import httpx
import pytest

from engine.api.generate import GenerateChunk, GenerateFinal, GenerateRequest, SamplingParams, WorkerInfo
from kvstore.keys import BlockKey, block_keys
from kvstore.proc import free_port
from router.workers.client import WorkerRejected, WorkerUnavailable
from router.workers.kv_index import KvIndex
from router.workers.vllm_client import (
    COMPLETIONS_PATH,
    VllmUnsupported,
    VllmWorkerClient,
    completion_body,
)
from tests.integrations.vllm_procs import ROOT, VllmPD, VllmServer

T = TypeVar("T")
NS = BlockKey(bytes(range(16)))


def _run(coro: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
    return asyncio.run(asyncio.wait_for(coro, timeout))


def _client(pd: VllmPD, server: VllmServer, **kw: Any) -> VllmWorkerClient:
    kw.setdefault("headers", pd.headers)
    return VllmWorkerClient(pd.worker_info(server), **kw)


async def _collect(client: VllmWorkerClient, request: GenerateRequest
                   ) -> tuple[list[int], list[GenerateChunk], GenerateFinal]:
    """The request's tokens, its chunks and its one final (checked to be last and alone)."""
    items = [item async for item in client.generate(request)]
    assert items and isinstance(items[-1], GenerateFinal)
    chunks = [i for i in items[:-1] if isinstance(i, GenerateChunk)]
    assert len(chunks) == len(items) - 1, "exactly one GenerateFinal, at the end"
    return [t for c in chunks for t in c.token_ids], chunks, items[-1]


def _prompt(pd: VllmPD, n: int, start: int) -> list[int]:
    """``n`` tokens of this repository's benchmark notes, from token ``start``."""
    ids = pd.tokenizer().encode((ROOT / "docs" / "benchmarks.md").read_text()).ids
    assert len(ids) >= start + n
    return ids[start:start + n]


def _vllm_completion(server: VllmServer, pd: VllmPD, **body: Any) -> list[int]:
    """The token ids of vLLM's own non-streamed answer, asked directly."""
    body = {"model": pd.model, "return_token_ids": True, **body, "stream": False}
    body.pop("stream_options", None)
    resp = httpx.post(server.url + COMPLETIONS_PATH, headers=pd.headers, timeout=120.0, json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["token_ids"]


def _greedy(max_tokens: int, **kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


# --- against vLLM --------------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.slow
def test_streamed_greedy_equals_vllms_own_answer(vllm_pd: VllmPD) -> None:
    pd, server = vllm_pd, vllm_pd.producer
    prompt = _prompt(pd, 300, 0)
    ref_ids = _vllm_completion(server, pd, prompt=prompt, max_tokens=16, temperature=0.0, ignore_eos=True)
    assert len(ref_ids) == 16

    async def go() -> None:
        client = _client(pd, server)
        try:
            tokens, chunks, final = await _collect(client, GenerateRequest("plain", prompt, _greedy(16)))
            assert tokens == ref_ids
            assert len(chunks) > 1, "streamed, not one answer"
            assert final.finish_reason == "length" and final.kv_transfer_params is None
            s = final.stats
            # The reference put the prompt's full blocks in vLLM's prefix cache.
            assert s.computed_prompt_tokens + s.device_hit_tokens == len(prompt)
            assert s.device_hit_tokens == len(prompt) // pd.block_size * pd.block_size
            assert s.first_token_s > 0 and s.first_token_s >= s.prefill_s > 0

            # Logprobs: the sampled token's, and the best alternatives, best first.
            tokens, chunks, _ = await _collect(client, GenerateRequest("lp", prompt, _greedy(3, logprobs=3)))
            assert tokens == ref_ids[:3]
            for chunk in chunks:
                assert chunk.logprobs is not None and len(chunk.logprobs) == len(chunk.token_ids)
                for token, lp in zip(chunk.token_ids, chunk.logprobs):
                    assert len(lp.top) == 3
                    assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
                    assert lp.top[0] == (token, lp.logprob) and lp.logprob <= 0.0
            assert await client.health()
        finally:
            await client.aclose()

    _run(go())


@pytest.mark.integration
@pytest.mark.slow
def test_prefill_then_decode_on_another_instance_equals_one_run(vllm_pd: VllmPD) -> None:
    pd = vllm_pd
    prompt = _prompt(pd, 300, 1000)
    blocks = len(prompt) // pd.block_size

    async def go() -> tuple[list[int], list[int], GenerateFinal, GenerateFinal]:
        prefill, decode = _client(pd, pd.producer), _client(pd, pd.consumer)
        try:
            first, _, pre = await _collect(prefill, GenerateRequest(
                "pd-1", prompt, _greedy(12), phase="prefill"))
            assert len(first) == 1
            before = pd.consumer.prompt_tokens_by_source()
            rest, _, dec = await _collect(decode, GenerateRequest(
                "pd-1", prompt, _greedy(12), output_token_ids=first,
                kv_transfer_params=pre.kv_transfer_params))
            after = pd.consumer.prompt_tokens_by_source()
            computed = after.get("local_compute", 0) - before.get("local_compute", 0)
            loaded = after.get("external_kv_transfer", 0) - before.get("external_kv_transfer", 0)
            assert computed < pd.block_size, (before, after)
            assert loaded == blocks * pd.block_size, (before, after)
            single, _, _ = await _collect(prefill, GenerateRequest("pd-ref", prompt, _greedy(12)))
            return first + rest, single, pre, dec
        finally:
            await prefill.aclose()
            await decode.aclose()

    tokens, single, pre, dec = _run(go())
    assert pre.kv_transfer_params == {"kvstore": {"blocks": blocks}}
    assert pre.finish_reason == "length" and pre.stats.computed_prompt_tokens == len(prompt)
    assert dec.finish_reason == "length"
    # vLLM's cached tokens count the connector's loads too (the API does not tell them apart).
    assert dec.stats.device_hit_tokens == blocks * pd.block_size
    assert dec.stats.computed_prompt_tokens == len(prompt) + 1 - blocks * pd.block_size
    assert len(tokens) == 12 and tokens == single


@pytest.mark.integration
@pytest.mark.slow
def test_a_frequency_penalty_continues_exactly_over_tokens_produced_elsewhere(vllm_pd: VllmPD) -> None:
    pd, server = vllm_pd, vllm_pd.producer
    penalized = _greedy(16, frequency_penalty=2.0)
    k = 8

    async def go(n: int, prompt: list[int]) -> tuple[list[int], list[int], list[int]]:
        client = _client(pd, server)
        try:
            plain, _, _ = await _collect(client, GenerateRequest(f"pen-{n}-0", prompt, _greedy(16)))
            full, _, _ = await _collect(client, GenerateRequest(f"pen-{n}-1", prompt, penalized))
            rest, _, _ = await _collect(client, GenerateRequest(
                f"pen-{n}-2", prompt, penalized, output_token_ids=full[:k]))
            return plain, full, rest
        finally:
            await client.aclose()

    # Every passage continues exactly; the test needs one where it shows: where the penalties
    # over the first k tokens change the rest (vLLM alone, given those tokens as prompt,
    # penalizes none of them and goes elsewhere). A passage the model continues with no token
    # twice shows nothing, whatever the client does.
    shown = False
    for n, start in enumerate((2000, 6000, 10000, 14000, 18000, 22000)):
        prompt = _prompt(pd, 120, start)
        plain, full, rest = _run(go(n, prompt))
        assert rest == full[k:], start
        body = completion_body(GenerateRequest(f"pen-{n}-3", prompt, penalized, output_token_ids=full[:k]),
                               pd.model)
        del body["logit_bias"]
        if full != plain and _vllm_completion(server, pd, **body) != full[k:]:
            shown = True
            break
    assert shown, "no passage of 6 whose rest the penalties over tokens produced elsewhere change"


@pytest.mark.integration
@pytest.mark.slow
def test_refusals_and_failures(vllm_pd: VllmPD) -> None:
    pd, server = vllm_pd, vllm_pd.producer
    prompt = _prompt(pd, 40, 3000)
    dead_port = free_port()   # nothing listens there
    dead = WorkerInfo("dead", f"http://127.0.0.1:{dead_port}", "prefill", pd.model, NS,
                      pd.block_size, 1, pd.max_model_len)

    async def go() -> None:
        client, anonymous = _client(pd, server), _client(pd, server, headers={})
        gone = VllmWorkerClient(dead, headers=pd.headers)
        try:
            with pytest.raises(WorkerRejected) as too_long:
                await _collect(client, GenerateRequest("long", prompt, _greedy(pd.max_model_len + 1)))
            assert too_long.value.status == 400 and "max_model_len" in str(too_long.value)
            with pytest.raises(WorkerRejected) as bad_bias:
                await _collect(client, GenerateRequest("bias", prompt, _greedy(2, logit_bias={10**7: 1.0})))
            assert bad_bias.value.status == 400 and "logit_bias" in str(bad_bias.value)
            with pytest.raises(WorkerRejected) as unauthorized:
                await _collect(anonymous, GenerateRequest("anon", prompt, _greedy(2)))
            assert unauthorized.value.status == 401
            with pytest.raises(WorkerUnavailable):
                await _collect(gone, GenerateRequest("gone", prompt, _greedy(2)))
            assert not await gone.health()
            assert not await gone.abort("gone")
            tokens, _, _ = await _collect(client, GenerateRequest("ok", prompt, _greedy(2)))
            assert len(tokens) == 2
        finally:
            for c in (client, anonymous, gone):
                await c.aclose()

    _run(go())


@pytest.mark.integration
@pytest.mark.slow
def test_abort_ends_a_long_stream_and_vllm_frees_it(vllm_pd: VllmPD) -> None:
    pd, server = vllm_pd, vllm_pd.producer
    prompt = _prompt(pd, 60, 4000)

    async def go() -> None:
        client = _client(pd, server)
        try:
            got: list[GenerateChunk | GenerateFinal] = []

            async def consume() -> None:
                async for item in client.generate(GenerateRequest("long-1", prompt, _greedy(3000))):
                    got.append(item)

            task = asyncio.create_task(consume())
            while sum(isinstance(i, GenerateChunk) for i in got) < 3:
                assert not task.done(), got
                await asyncio.sleep(0.02)
            assert await client.abort("long-1")
            t0 = time.monotonic()
            await asyncio.wait_for(task, 10)
            assert time.monotonic() - t0 < 5
            assert isinstance(got[-1], GenerateFinal) and got[-1].finish_reason == "abort"
            assert sum(isinstance(i, GenerateFinal) for i in got) == 1
            assert not await client.abort("long-1")
            # vLLM dropped it (else it runs on for thousands of tokens) and keeps serving.
            deadline = time.monotonic() + 10
            while await asyncio.to_thread(server.metric, "vllm:num_requests_running") > 0:
                assert time.monotonic() < deadline, "vLLM still runs the aborted request"
                await asyncio.sleep(0.2)
            tokens, _, final = await _collect(client, GenerateRequest("after", prompt, _greedy(3)))
            assert len(tokens) == 3 and final.finish_reason == "length"
        finally:
            await client.aclose()

    _run(go())


@pytest.mark.integration
@pytest.mark.slow
def test_follow_events_keys_vllms_kv_events_into_the_index(vllm_pd: VllmPD) -> None:
    pytest.importorskip("router.workers.vllm_events")
    from router.workers.vllm_client import zmq_kv_events

    pd, server = vllm_pd, vllm_pd.producer
    prompt = _prompt(pd, 100, 5000)
    info = pd.worker_info(server)   # its registration: the namespace its connector keys under
    keys = block_keys(info.namespace, prompt, pd.block_size)
    assert len(keys) == 3

    async def go() -> None:
        client = VllmWorkerClient(info, headers=pd.headers,
                                  events=zmq_kv_events(info, server.kv_events, server.kv_replay))
        index = KvIndex()
        follow = asyncio.create_task(client.follow_events(index, lambda load: None))
        try:
            await asyncio.sleep(0.5)   # subscribed before the blocks are stored
            assert index.match(keys).get(info.worker_id, 0) == 0
            await _collect(client, GenerateRequest("events", prompt, _greedy(2)))
            deadline = time.monotonic() + 10
            while index.match(keys).get(info.worker_id, 0) < len(keys):
                assert time.monotonic() < deadline, index.match(keys)
                await asyncio.sleep(0.05)
        finally:
            follow.cancel()
            await asyncio.wait([follow])
            await client.aclose()

    _run(go())


# --- without vLLM --------------------------------------------------------------------------


def test_completion_body_maps_every_sampling_field() -> None:
    sp = SamplingParams(max_tokens=20, temperature=0.7, top_p=0.9, top_k=40, seed=7,
                        stop_token_ids=(5, 6), ignore_eos=True, logprobs=2, repetition_penalty=1.1,
                        frequency_penalty=0.0, presence_penalty=0.0, min_p=0.05, min_tokens=6,
                        logit_bias={9: -3.0})
    body = completion_body(GenerateRequest("r", [1, 2, 3], sp, output_token_ids=[4, 4],
                                           cache_salt="salt", kv_transfer_params={"a": 1}), "m")
    assert body == {
        "model": "m", "prompt": [1, 2, 3, 4, 4], "max_tokens": 18, "min_tokens": 4,
        "temperature": 0.7, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1,
        "frequency_penalty": 0.0, "presence_penalty": 0.0, "stop_token_ids": [5, 6],
        "ignore_eos": True, "n": 1, "echo": False, "return_token_ids": True, "request_id": "r",
        "stream": True, "stream_options": {"include_usage": True}, "seed": 7,
        "logit_bias": {"9": -3.0}, "logprobs": 2, "return_tokens_as_token_ids": True,
        "cache_salt": "salt", "kv_transfer_params": {"a": 1}}
    plain = completion_body(GenerateRequest("r", [1], SamplingParams()), "m")
    assert not {"seed", "logit_bias", "logprobs", "cache_salt", "kv_transfer_params"} & plain.keys()
    prefill = completion_body(GenerateRequest("r", [1, 2], sp, phase="prefill"), "m")
    assert prefill["max_tokens"] == 1 and prefill["min_tokens"] == 1
    assert prefill["stream"] is False and "stream_options" not in prefill


def test_penalties_over_tokens_produced_elsewhere_become_logit_bias() -> None:
    sp = SamplingParams(max_tokens=10, frequency_penalty=0.5, logit_bias={7: 1.0})
    body = completion_body(GenerateRequest("r", [1], sp, output_token_ids=[7, 8, 7]), "m")
    assert body["logit_bias"] == {"7": 1.0 - 0.5 * 2, "8": -0.5}
    with pytest.raises(VllmUnsupported, match="presence_penalty"):   # vLLM would charge a recurrence twice
        completion_body(GenerateRequest("r", [1], SamplingParams(
            max_tokens=10, frequency_penalty=0.5, presence_penalty=0.25), output_token_ids=[7]), "m")
    assert "logit_bias" not in completion_body(GenerateRequest("r", [1], SamplingParams(
        max_tokens=10, presence_penalty=0.25)), "m")   # a presence penalty alone is vLLM's own
    assert "logit_bias" not in completion_body(GenerateRequest("r", [1], SamplingParams(
        max_tokens=10, frequency_penalty=0.5)), "m")   # nothing produced elsewhere
    with pytest.raises(VllmUnsupported, match="repetition_penalty"):
        completion_body(GenerateRequest("r", [1], SamplingParams(
            max_tokens=10, frequency_penalty=0.5, repetition_penalty=1.2), output_token_ids=[3]), "m")
    with pytest.raises(VllmUnsupported, match="bound"):
        completion_body(GenerateRequest("r", [1], SamplingParams(
            max_tokens=200, frequency_penalty=2.0), output_token_ids=[3] * 60), "m")
    with pytest.raises(VllmUnsupported, match="nothing left"):
        completion_body(GenerateRequest("r", [1], SamplingParams(max_tokens=2), output_token_ids=[3, 4]), "m")


def test_a_refused_request_is_worker_rejected_and_not_sent() -> None:
    info = WorkerInfo("w", "http://127.0.0.1:9", "decode", "m", NS, 32, 1, 4096)  # nothing there

    async def go() -> None:
        client = VllmWorkerClient(info)
        try:
            with pytest.raises(WorkerRejected, match="nothing left") as exc:
                await _collect(client, GenerateRequest("r", [1], SamplingParams(max_tokens=1),
                                                       output_token_ids=[2]))
            assert exc.value.status == 400
        finally:
            await client.aclose()

    _run(go(), 10)


def test_follow_events_without_a_source_registers_and_waits() -> None:
    info = WorkerInfo("w", "http://127.0.0.1:9", "decode", "m", NS, 32, 1, 4096)

    async def go() -> None:
        client = VllmWorkerClient(info)
        index = KvIndex()
        task = asyncio.create_task(client.follow_events(index, lambda load: None))
        await asyncio.sleep(0.1)
        assert index.workers == ["w"] and not task.done()
        task.cancel()
        await asyncio.wait([task])
        assert task.cancelled()
        await client.aclose()

    _run(go(), 10)
